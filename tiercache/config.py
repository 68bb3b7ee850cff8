"""The one configuration model, whether it comes from vLLM's kv_connector_extra_config,
a YAML file, or TIERCACHE_* environment overrides."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from tiercache.config_env import env_overrides
from tiercache.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
PEER_PORT_SPAN = 100  # ports from peer.port that UCX may listen on
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: Any) -> int:
    """Accept an int of bytes or a string such as "512MiB", "8GiB" or "8GB"."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '8GiB', not a bool")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{value!r} is not a size: use bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{value!r} is not a size: use bytes or a string like '8GiB'")
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


ByteSize = Annotated[int, BeforeValidator(parse_byte_size)]


def format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CpuTierConfig(_Strict):
    capacity: ByteSize = Field(
        default=2 * 2**30, description="host memory for cached blocks, per worker (one slot per block)"
    )


class DiskTierConfig(_Strict):
    path: Path = Field(description="absolute path of the folder that holds the disk tier (local NVMe)")
    capacity: ByteSize = Field(
        default=100 * 2**30,
        description="bytes under `path`: one budget, shared by every engine and TP rank that uses the path",
    )
    # O_DIRECT bypasses the page cache: right for NVMe that holds far more than RAM.
    o_direct: bool = Field(
        default=False, description="read and write objects with O_DIRECT, bypassing the page cache"
    )
    fsync: bool = Field(
        default=False,
        description="fsync each object before it becomes visible: durable across a power loss, slower",
    )
    # Where the KV cache lives in host memory (vLLM's CPU backend), a hit on disk is
    # read straight into the paged KV beside the forward, layer by layer, as a CPU
    # hit is copied (connector/disk_reads.py). Off, or on GPUs, it is staged into a
    # CPU slot first, outside any forward.
    load_in_forward: bool = Field(
        default=True,
        description="vLLM's CPU backend with one tensor-parallel rank: read a disk hit straight into the "
        "paged KV during the forward, layer by layer; off (and on GPUs) it is staged into a CPU slot first",
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        if not path.is_absolute():
            raise ValueError(f"disk.path must be an absolute path, got {str(path)!r}")
        return path


class S3TierConfig(_Strict):
    # AWS wants 3-63 characters; S3-compatible stores vary, and the endpoint refuses
    # what it cannot hold, so only the characters are checked here ("kv" is allowed).
    bucket: str = Field(min_length=1, max_length=63, description="the bucket that holds the S3 tier")
    prefix: str = Field(default="", description="key prefix for every object tiercache writes in the bucket")
    endpoint_url: str | None = Field(
        default=None, description="an S3-compatible endpoint (MinIO, Ceph, SeaweedFS); unset: AWS S3"
    )
    region: str | None = Field(
        default=None, description="the bucket's region; unset: the AWS client's default"
    )
    path_style: bool = Field(
        default=True, description="address the bucket in the URL path rather than as a host name"
    )
    capacity: ByteSize | None = Field(
        default=None,
        description="this namespace's budget in the bucket, kept by the garbage collector (`tiercache serve` "
        "or `tiercache gc`); unset, nothing bounds the S3 tier or its Redis index",
    )
    max_concurrency: int = Field(
        default=16, ge=1, le=256, description="S3 requests in flight at once, per worker"
    )
    connect_timeout: float = Field(default=2.0, gt=0, le=60, description="seconds to open a connection to S3")
    read_timeout: float = Field(default=10.0, gt=0, le=300, description="seconds to wait for S3 to answer")
    max_attempts: int = Field(default=3, ge=1, le=10, description="tries per S3 request, the first included")
    # Runs: consecutive blocks of one request go into one object, up to
    # this many blocks or bytes of pages, whichever comes first; 1 writes one object
    # per block. A request's run ships when its prompt's last block is stored or the
    # request finishes; pack_flush_seconds bounds the wait otherwise (decode blocks,
    # writes outside a request). A prompt's chunks come one forward apart, which took
    # seconds on vLLM's CPU build: a short bound split its runs.
    pack_blocks: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="most consecutive blocks of one request stored in one S3 object (a run); 1 writes "
        "one object per block",
    )
    pack_bytes: ByteSize = Field(default=16 * 2**20, description="most bytes of KV pages in one run object")
    pack_flush_seconds: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="seconds a partial run waits for more of its request's blocks before it is uploaded",
    )

    def run_blocks(self, slot_bytes: int) -> int:
        """Blocks per run for blocks of `slot_bytes`: pack_blocks, fewer if pack_bytes says so."""
        return max(1, min(self.pack_blocks, int(self.pack_bytes) // max(1, slot_bytes)))

    @field_validator("pack_bytes")
    @classmethod
    def _pack_bytes(cls, size: int) -> int:
        if int(size) < 1:
            raise ValueError("s3.pack_bytes must be at least 1 byte (one block always fits a run)")
        return size

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, bucket: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([a-z0-9.\-]{0,61}[a-z0-9])?", bucket):
            raise ValueError(f"s3.bucket {bucket!r} is not a valid S3 bucket name")
        return bucket

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"s3.prefix {prefix!r} must be relative and must not contain '..'")
        return prefix

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"s3.endpoint_url {url!r} must start with http:// or https://")
        return url


class RedisConfig(_Strict):
    # Small on purpose: the scheduler must never wait long on a shared lookup.
    socket_timeout: float = Field(
        default=0.25, gt=0, le=30, description="seconds a Redis command (a shared lookup) may take"
    )
    connect_timeout: float = Field(default=0.25, gt=0, le=30, description="seconds to connect to Redis")
    # After a failure, shared lookups are skipped (a miss) for this long.
    retry_backoff: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="seconds Redis is treated as down after a failure (lookups miss)",
    )
    max_backoff: float = Field(
        default=30.0, ge=0, le=600, description="the longest that back-off grows to after repeated failures"
    )
    ssl_ca_certs: Path | None = Field(
        default=None, description="CA bundle to verify a `rediss://` server with; unset: the system's"
    )
    write_lease_ttl: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="seconds a writer's lease on an S3 object lasts if not released",
    )
    read_lease_ttl: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="seconds a reader's lease (which keeps the GC off an object) lasts if not released",
    )


def _on_off(value: Any) -> Any:
    """YAML 1.1 (PyYAML, and so TIERCACHE_* overrides) reads a bare on/off as a bool."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class MoverConfig(_Strict):
    policy: Literal["write_through", "write_back", "selective"] = Field(
        default="write_through",
        description="write_through: every stored block goes to every tier; write_back: to the lower tiers "
        "when the CPU tier evicts it; selective: the CPU tier is a segmented LRU (a hit protects a block "
        "from scans) and an evicted block goes only to the tiers whose admission rule it passes (the "
        "selective_* settings)",
    )
    selective_protected_share: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="selective: the most of the CPU tier's slots that blocks hit in it may hold, safe from "
        "eviction while blocks not hit since they came in remain",
    )
    selective_disk_min_requests: int = Field(
        default=2,
        ge=1,
        le=15,
        description="selective: once the disk is full, a block the CPU tier evicts is written to it only if "
        "this many requests asked for it lately and it is no less asked for than the disk's least recently "
        "used block (until it is full, every evicted block is written)",
    )
    selective_s3_min_requests: int = Field(
        default=2,
        ge=1,
        le=15,
        description="selective: a block the CPU tier evicts is written to S3 only if this many requests "
        "asked for it lately, on this node or (with redis_url) across the fleet",
    )
    selective_everywhere_min_requests: int = Field(
        default=8,
        ge=0,
        le=1_000_000,
        description="selective: a block asked for by this many requests lately (on this node, or across "
        "the fleet) is written to the disk and S3 as soon as it is in the CPU tier, not when evicted "
        "(0: never; above 15 only the fleet's counts can reach it)",
    )
    selective_fleet_ttl_seconds: float = Field(
        default=600.0,
        ge=0,
        le=86_400,
        description="selective, with redis_url and S3: how long a request counts in the fleet-wide request "
        "counts kept in Redis (between this and twice this); 0: each node counts only its own requests",
    )
    queue_depth: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="queued writes to lower tiers; past it a store is dropped",
    )
    workers: int = Field(
        default=4,
        ge=1,
        le=64,
        description="threads per pool: write-down, disk staging, S3 staging, and disk reads for hits",
    )
    shutdown_flush_seconds: float = Field(
        default=10.0, ge=0, le=600, description="seconds at shutdown to finish queued writes"
    )
    load_deadline_seconds: float = Field(
        default=20.0,
        gt=0,
        le=600,
        description="a hit staged from disk or S3 that is not in its CPU slots by then is given up "
        "and recomputed (its slots are freed once the late read ends, and never served)",
    )
    upload_slot_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="the most of the CPU tier's slots that S3 uploads may hold at once; past it a "
        "store goes to disk only (counted as a dropped S3 write), so a slow S3 cannot pin the tier",
    )
    cost_model: Annotated[Literal["on", "off"], BeforeValidator(_on_off)] = Field(
        default="on",
        description="load a hit from disk or S3 only as far as its measured load time beats "
        "recomputing it (the engine's measured prefill rate); off loads every hit it finds",
    )


class PresenceConfig(_Strict):
    """What this instance publishes to Redis for routers: which blocks its CPU and disk
    tiers hold (tiercache/index/presence.py), read by the service's `/v1/lookup`."""

    enabled: bool = Field(
        default=True, description="publish this instance's CPU and disk blocks (needs redis_url)"
    )
    ttl: float = Field(
        default=30.0, ge=3, le=3600, description="seconds an instance's presence outlives its last refresh"
    )
    interval: float = Field(default=1.0, gt=0, le=60, description="seconds between two batches of changes")

    @model_validator(mode="after")
    def _ttl_covers_refreshes(self) -> PresenceConfig:
        if self.ttl <= 2 * self.interval:
            raise ValueError("presence.ttl must exceed twice presence.interval, or a live instance expires")
        return self


class PeerConfig(_Strict):
    """The peer tier: blocks read straight out of another live instance's CPU tier over
    NIXL, found through the presence each instance publishes in Redis."""

    enabled: bool = Field(
        default=False,
        description="share this instance's CPU tier with the other live instances of the deployment over "
        "NIXL, and load a request's blocks from theirs where this instance's CPU tier ends: in place of its "
        "disk where the loads measured say a peer is faster, past it, and before S3 (needs redis_url, "
        "presence.enabled and the nixl-cu12 package, without which the tier is off "
        "with a warning; instances share blocks only where their block hashes agree: a cryptographic "
        "prefix_caching_hash_algo, or one PYTHONHASHSEED; for a model of several KV cache groups, every "
        "group's blocks are read from the instance presence names for the first full-attention group's)",
    )
    host: str | None = Field(
        default=None,
        max_length=253,
        description="the IP address of this machine's network interface that peers reach it through; "
        "unset, every interface UCX finds",
    )
    port: int = Field(
        default=0,
        ge=0,
        le=65535 - PEER_PORT_SPAN,
        description=f"first TCP port of the {PEER_PORT_SPAN} ports this instance's NIXL agents listen "
        "in (for a firewall rule); 0, any free port",
    )
    ttl: float = Field(
        default=15.0,
        ge=3,
        le=3600,
        description="seconds a worker's NIXL address stays in Redis after its last refresh",
    )
    skip_seconds: float = Field(
        default=10.0,
        ge=0,
        le=3600,
        description="seconds a peer that failed a read (dead, late, refused, wrong bytes) is not asked again",
    )

    @field_validator("host")
    @classmethod
    def _host(cls, host: str | None) -> str | None:
        if host is not None:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"peer.host must be an IP address, got {host!r}") from None
        return host


INTEGRITY_KEY_MIN = 32


class TierCacheConfig(_Strict):
    # A refused value is never echoed in an error: it may be a secret (integrity_key).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    namespace: str = Field(
        default="default",
        min_length=1,
        max_length=128,
        description="isolates caches that must never share blocks (one per deployment or tenant)",
    )
    redis_url: str | None = Field(
        default=None,
        description="the shared index: `redis://`, `rediss://` (TLS) or `redis+cluster://`; unset, an "
        "index inside this process (no sharing between instances, no S3 tier)",
    )
    cpu: CpuTierConfig = Field(default=CpuTierConfig(), description="the host-memory tier, always on")
    disk: DiskTierConfig | None = Field(default=None, description="the local disk tier; absent: off")
    s3: S3TierConfig | None = Field(
        default=None, description="the shared S3 tier (needs `redis_url`); absent: off"
    )
    redis: RedisConfig = Field(default=RedisConfig(), description="how tiercache talks to Redis")
    movers: MoverConfig = Field(
        default=MoverConfig(), description="the threads that move blocks between tiers"
    )
    store_decode: bool = Field(default=False, description="also store blocks filled by generated tokens")
    model_revision: str | None = Field(
        default=None,
        description="names the weights in every key; unset, a fingerprint of the weight files does, so "
        "set it where nodes copy a model at different times",
    )
    instance_id: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]*$",
        description="this vLLM instance's name in lookup answers: what a router maps to an endpoint "
        "(the pod's name, host:port). Default: <hostname>-<engine core pid>",
    )
    presence: PresenceConfig = Field(
        default=PresenceConfig(), description="what this instance tells routers it holds, through Redis"
    )
    peer: PeerConfig = Field(
        default=PeerConfig(), description="reading blocks from other instances' CPU tiers (off by default)"
    )
    integrity_key: SecretStr | None = Field(
        default=None,
        description="a secret every writer and reader of the disk and S3 tiers shares: each object "
        "carries an HMAC-SHA256 over its header and pages made with it, and an object without a "
        "valid one is a miss. At least 32 characters; set it through TIERCACHE_INTEGRITY_KEY (or "
        "TIERCACHE_INTEGRITY_KEY_FILE). Unset, anyone who can write to the bucket (or the disk) can "
        "forge an object that is served",
    )

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, namespace: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*", namespace):
            raise ValueError(f"namespace {namespace!r} may hold only letters, digits, '.', '_' and '-'")
        return namespace

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^(rediss?|redis\+cluster|rediss\+cluster)://", url):
            raise ValueError(
                f"redis_url must start with redis://, rediss://, redis+cluster:// "
                f"or rediss+cluster://, got {redact_url(url)!r}"
            )
        return url

    @field_validator("integrity_key")
    @classmethod
    def _integrity_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and len(key.get_secret_value()) < INTEGRITY_KEY_MIN:
            raise ValueError(
                f"integrity_key must be at least {INTEGRITY_KEY_MIN} characters "
                "(for example the output of `openssl rand -hex 32`)"
            )
        return key

    def integrity_key_bytes(self) -> bytes | None:
        """The integrity key as the MAC takes it, or None when objects are unsigned."""
        return self.integrity_key.get_secret_value().encode() if self.integrity_key else None

    @model_validator(mode="after")
    def _s3_needs_redis(self) -> TierCacheConfig:
        if self.s3 is not None and self.redis_url is None:
            raise ValueError(
                "s3 needs redis_url: the shared S3 tier is indexed in Redis "
                "(without Redis, use the cpu and disk tiers alone)"
            )
        return self

    @model_validator(mode="after")
    def _peer_needs_redis(self) -> TierCacheConfig:
        if self.peer.enabled and self.redis_url is None:
            raise ValueError(
                "peer.enabled needs redis_url: instances find each other's CPU tiers through Redis"
            )
        return self

    def redacted(self) -> dict[str, Any]:
        """The resolved config as plain data, with any password in redis_url hidden
        (and integrity_key, a SecretStr, dumped as asterisks)."""
        data = self.model_dump(mode="json")
        if data.get("redis_url"):
            data["redis_url"] = redact_url(data["redis_url"])
        return data


# The authority's password runs to its LAST "@" (a password may hold "@"); the
# authority ends at the first "/", "?" or "#" after the scheme.
_URL_PASSWORD = re.compile(r"(://[^:/?#@]*:)[^/?#]*@")
# Query parameters that carry a secret (redis-py reads some options from the query).
_QUERY_SECRET = re.compile(r"([?&][^=&#]*(?:password|passwd|pwd|secret|token)=)[^&#]*", re.IGNORECASE)


def unbounded_warnings(config: TierCacheConfig) -> list[str]:
    """Settings that let storage grow without bound: logged when a tier engine or the
    service starts, and printed by `tiercache config check`."""
    if config.s3 is not None and config.s3.capacity is None:
        return [
            "s3.capacity is not set: nothing bounds the S3 tier or its Redis index, which grow "
            "for as long as new blocks are stored; set s3.capacity (this namespace's GC budget, "
            "kept by `tiercache serve` or `tiercache gc`) to keep both in bounds"
        ]
    return []


def redact_url(url: str) -> str:
    """The URL with any password (in the authority or the query) shown as ***."""
    return _QUERY_SECRET.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", url, count=1))


# Settings that were removed, and why: a configuration that still sets one is told.
_REMOVED = {
    "movers.promote_on_hit": "removed: it never had an effect (a hit from disk or S3 is always "
    "promoted into the CPU tier); delete it",
    "movers.yield_to_loads": "removed: holding writes back while a step served a hit made no "
    "measurable difference to serving (docs/benchmarks.md); delete it",
    "movers.upload_process": "removed: S3 uploads run on the worker's own upload threads, since "
    "an upload process of their own made no measurable difference to serving "
    "(docs/benchmarks.md); delete it",
}


def _problems(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = _REMOVED.get(field, "unknown key")
        lines.append(f"{field}: {message}")
    return lines


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_config(
    data: dict[str, Any] | None,
    source: str = "config",
    environ: dict[str, str] | None = None,
) -> TierCacheConfig:
    """Validate a config dict with environment overrides applied on top."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(source, [f"(top level): expected a mapping, got {type(data).__name__}"])
    merged = _merge(data or {}, env_overrides(environ))
    try:
        return TierCacheConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(source, _problems(error)) from None


def load_config(path: str | Path, environ: dict[str, str] | None = None) -> TierCacheConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(str(path), [f"cannot read the file: {error.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(str(path), [f"not valid YAML: {error}"]) from None
    return build_config(data, source=str(path), environ=environ)
