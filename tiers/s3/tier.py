"""The S3 tier: boto3 against any S3-compatible endpoint, with a bounded pool of
parallel transfers, bounded timeouts and retries, and a checksum in every object's
header verified on every read."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from tiercache.config import S3TierConfig
from tiercache.index.keys import split_key
from tiercache.metrics import S3_BYTES, S3_REQUESTS, TIER_ERRORS, timed
from tiercache.tiers import S3
from tiercache.tiers.format import CorruptObject, PageShape, header_length
from tiercache.tiers.s3.runs import (
    FrameWant,
    RunGeometry,
    RunHeader,
    decode_run_header,
    parse_run_name,
    read_frames,
    run_object_name,
)

log = logging.getLogger(__name__)
TIER = S3
SUFFIX = ".safetensors"
_MISSING = {"404", "NoSuchKey", "NotFound"}


class Fetch(enum.Enum):
    """What one GET found. Only MISSING and CORRUPT say anything about the object:
    every other failure (a timeout, 503 SlowDown, 403 AccessDenied, a cut connection)
    says only that this read did not work."""

    OK = "ok"
    MISSING = "missing"  # NoSuchKey / 404: there is no object
    CORRUPT = "corrupt"  # a bad header or checksum: the object was deleted
    UNAVAILABLE = "unavailable"  # the store did not answer, or refused this read


def make_client(config: S3TierConfig):
    boto_config = BotoConfig(
        region_name=config.region,
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        retries={"max_attempts": config.max_attempts, "mode": "standard"},
        max_pool_connections=config.max_concurrency,
        s3={"addressing_style": "path" if config.path_style else "auto"},
        # Our own checksum covers the payload; skip botocore's extra CRC pass.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # Credentials come from the standard AWS chain and never pass through here.
    client = boto3.session.Session().client("s3", endpoint_url=config.endpoint_url, config=boto_config)
    count_requests(client)
    return client


# botocore operation names -> the `op` label of tiercache_s3_requests_total.
_OPS = {
    "PutObject": "put",
    "GetObject": "get",
    "HeadObject": "head",
    "DeleteObject": "delete",
    "DeleteObjects": "delete",
    "ListObjectsV2": "list",
    "ListObjects": "list",
}


def _count_request(event_name: str = "", **_: Any) -> None:
    operation = event_name.rsplit(".", 1)[-1]
    S3_REQUESTS.labels(_OPS.get(operation, "other")).inc()


def count_requests(client: Any) -> None:
    """Count every HTTP request the client sends (each retry too: each is billed).
    botocore's "before-send" fires once per attempt; registering twice is harmless."""
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is not None:  # a stand-in client (tests, tools) sends nothing to count
        events.register("before-send.s3", _count_request, unique_id="tiercache-s3-requests")


class S3Tier:
    def __init__(self, config: S3TierConfig, client=None, integrity_key: bytes | None = None):
        """`integrity_key`: objects are served only if their MAC was made with it (see
        format.sign); None checks the plain checksum, which any bucket writer can forge."""
        self.config = config
        self.integrity_key = integrity_key
        self.bucket = config.bucket
        self.client = client or make_client(config)
        count_requests(self.client)
        self.pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="tiercache-s3")

    def object_name(self, key: str) -> str:
        digest, block = split_key(key)
        return f"{self.config.prefix}{digest}/{block}{SUFFIX}"

    def key_of(self, name: str) -> str | None:
        if not name.startswith(self.config.prefix) or not name.endswith(SUFFIX):
            return None
        key = name[len(self.config.prefix) : -len(SUFFIX)]
        try:
            split_key(key)
        except ValueError:
            return None
        return key

    # -- runs: many blocks per object (runs.py) -------------------------------------
    def run_name(self, rank_digest: str, run_hex: str) -> str:
        return run_object_name(self.config.prefix, rank_digest, run_hex)

    def put_run(self, rank_digest: str, run_hex: str, parts: Sequence[memoryview]) -> bool:
        """One PUT of a whole run (atomic). False on failure. The parts (views of CPU
        slots) must not change until it returns."""
        body = ObjectBody(*parts)
        try:
            with timed(TIER, "put", len(body)):
                self.client.put_object(Bucket=self.bucket, Key=self.run_name(rank_digest, run_hex), Body=body)
            S3_BYTES.labels("up").inc(len(body))
            return True
        except (BotoCoreError, ClientError) as error:
            TIER_ERRORS.labels(TIER, _kind(error)).inc()
            log.warning("s3 tier: dropped store of run %s/%s: %s", rank_digest, run_hex, _describe(error))
            return False

    def fetch_run(
        self,
        rank_digest: str,
        run_hex: str,
        geometry: RunGeometry,
        wants: Sequence[FrameWant],
        expect: PageShape | None = None,
    ) -> list[Fetch]:
        """One ranged GET of the frames wants[0].position..wants[-1].position (the
        wants are consecutive), each block checked on its own: a Fetch per want. A
        corrupt frame is CORRUPT alone; the run object is never deleted here, since its
        other blocks may be good (the caller unindexes the bad ones)."""
        first, last = wants[0].position, wants[-1].position
        start, end = geometry.byte_range(first, last)
        results: dict[int, Fetch] = {}
        name = self.run_name(rank_digest, run_hex)
        try:
            with timed(TIER, "get", end - start + 1):
                response = self.client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end}")
                stream = response["Body"]
                try:
                    for want, error in read_frames(stream, geometry, wants, expect, self.integrity_key):
                        if error is not None:
                            TIER_ERRORS.labels(TIER, "corrupt").inc()
                            log.warning("s3 tier: corrupt block %s in run %s: %s", want.key, name, error)
                        results[want.position] = Fetch.OK if error is None else Fetch.CORRUPT
                finally:
                    stream.close()
            S3_BYTES.labels("down").inc(end - start + 1)
        except ClientError as error:
            code = _code(error)
            if code in _MISSING:
                return [Fetch.MISSING] * len(wants)
            if code in ("InvalidRange", "416"):  # shorter than its index entry says
                return [results.get(w.position, Fetch.CORRUPT) for w in wants]
            TIER_ERRORS.labels(TIER, _kind(error)).inc()
            log.warning("s3 tier: get of run %s failed: %s", name, _describe(error))
        except BotoCoreError as error:
            TIER_ERRORS.labels(TIER, _kind(error)).inc()
            log.warning("s3 tier: get of run %s failed: %s", name, _describe(error))
        except CorruptObject as error:  # the body ended early: the frame it ended in and after
            TIER_ERRORS.labels(TIER, "corrupt").inc()
            log.warning("s3 tier: run %s truncated: %s", name, error)
            return [results.get(w.position, Fetch.CORRUPT) for w in wants]
        except OSError as error:  # a connection cut mid-body
            TIER_ERRORS.labels(TIER, "io").inc()
            log.warning("s3 tier: get of run %s broke off: %s", name, error)
        return [results.get(w.position, Fetch.UNAVAILABLE) for w in wants]

    def read_run_header(self, rank_digest: str, run_hex: str) -> RunHeader:
        """A run's table of contents, from ranged GETs (one when it fits 4 KiB, as it
        does for up to about 40 blocks). Raises CorruptObject, or ClientError."""
        name = self.run_name(rank_digest, run_hex)
        head = self._ranged_get(name, 0, 4096)
        end = 8 + header_length(head[:8])
        if end > len(head):
            head += self._ranged_get(name, len(head), end)
        if end > len(head):
            raise CorruptObject(f"run shorter than its {end}-byte header")
        return decode_run_header(head[8:end])

    def _ranged_get(self, name: str, start: int, stop: int) -> bytes:
        response = self.client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes={start}-{stop - 1}")
        data = response["Body"].read()
        S3_BYTES.labels("down").inc(len(data))
        return data

    def delete_run(self, rank_digest: str, run_hex: str) -> bool:
        try:
            with timed(TIER, "delete"):
                self.client.delete_object(Bucket=self.bucket, Key=self.run_name(rank_digest, run_hex))
            return True
        except (BotoCoreError, ClientError) as error:
            TIER_ERRORS.labels(TIER, _kind(error)).inc()
            log.warning("s3 tier: delete of run %s/%s failed: %s", rank_digest, run_hex, _describe(error))
            return False

    def list_runs(self, digest: str | None = None) -> Iterator[tuple[str, str, int, datetime]]:
        """Yield (rank digest, run hex, size, last_modified) of every run object under
        the prefix (of one rank digest when given). Runs are spread over hashed
        leading folders, so this lists the whole prefix and filters."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.config.prefix):
            for item in page.get("Contents", ()):
                parsed = parse_run_name(self.config.prefix, item["Key"])
                if parsed is not None and (digest is None or parsed[0] == digest):
                    yield parsed[0], parsed[1], item["Size"], item["LastModified"]

    name = TIER

    def list_objects(self, digest: str | None = None):
        """Yield (key, size, last_modified) for every per-block object under the prefix:
        what tiercache wrote before runs. Nothing writes or reads them any
        more: GC reclaims them (legacy.py)."""
        prefix = self.config.prefix + (f"{digest}/" if digest else "")
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                key = self.key_of(item["Key"])
                if key is not None:
                    yield key, item["Size"], item["LastModified"]

    def ping(self) -> bool:
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return True
        except (BotoCoreError, ClientError):
            return False

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ObjectBody:
    """An object's bytes (its parts: a header then its pages, or a run's frames) as
    the seekable stream botocore takes for a request body, handing out views rather
    than copies. botocore hashes the body (SigV4 over plain http) and the socket
    sends it straight from the CPU tier's slot: assembling one buffer first was
    another pass over every byte, and on a small host the model's decode is bound by the same memory bus."""

    def __init__(self, *parts: bytes | memoryview):
        self._parts = [memoryview(part).cast("B") for part in parts]
        self._starts = []
        start = 0
        for part in self._parts:
            self._starts.append(start)
            start += len(part)
        self._size = start
        self._position = 0

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, self._size)[whence]
        self._position = min(max(base + offset, 0), self._size)
        return self._position

    def read(self, size: int | None = -1) -> memoryview | bytes:
        """Up to `size` bytes from the current part (a short read where the header
        ends); everything left, copied, when `size` is negative or None."""
        if size is None or size < 0:
            chunks = []
            while chunk := self.read(self._size):
                chunks.append(bytes(chunk))
            return b"".join(chunks)
        for part, begins in zip(self._parts, self._starts, strict=True):
            if self._position < begins + len(part):
                chunk = part[self._position - begins : self._position - begins + size]
                self._position += len(chunk)
                return chunk
        return b""


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _kind(error: Exception) -> str:
    if isinstance(error, ClientError):
        return "client_error"
    return "unreachable"


def _describe(error: Exception) -> str:
    # botocore messages name the endpoint and operation, never the credentials.
    return f"{type(error).__name__}: {error}"
