"""Start real servers on free loopback ports: redis-server (the Debian package) and
moto's S3 server (a real HTTP endpoint), in threads of this process or in its own."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class RedisServer:
    """One redis-server process; stop() and start() keep its port, to test outages."""

    def __init__(
        self, port: int | None = None, extra_args: tuple[str, ...] = (), cpus: set[int] | None = None
    ):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: run scripts/bootstrap.sh (apt-get install redis-server)"
            )
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = extra_args
        self.cpus = cpus
        self.dir = tempfile.mkdtemp(prefix="tiercache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            *self.extra_args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_bound_to(self.cpus)
        )
        _wait_port(self.port)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class S3Endpoint:
    url: str
    server: Any  # a ThreadedMotoServer, or None for one in its own process

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_moto(port: int | None = None) -> S3Endpoint:
    """moto's threaded S3 server on loopback. Sets dummy credentials for the process
    if none are set (moto accepts any)."""
    from moto.server import ThreadedMotoServer

    # One log line per request drowns the demo's and the tests' output.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = port or free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    _wait_port(port)
    return S3Endpoint(url=f"http://127.0.0.1:{port}", server=server)


def _bound_to(cpus: set[int] | None):
    """A preexec_fn that binds the child (and every thread it will start) to `cpus`."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


@contextmanager
def moto_process(bucket: str, cpus: set[int] | None = None):
    """moto's S3 server in a process of its own (as a real S3 endpoint would be), with
    `bucket`: it shares neither the interpreter lock nor the memory of the process
    that measures its clients. With `cpus`, it runs only there: a benchmark keeps it
    off the cores the model computes on, as a remote endpoint would be. Yields the
    endpoint URL."""
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_bound_to(cpus),
    )
    try:
        _wait_port(port, timeout=60)
        url = f"http://127.0.0.1:{port}"
        create_bucket(url, bucket)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def create_bucket(endpoint_url: str | None, bucket: str, region: str = "us-east-1") -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
    with suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)


@contextmanager
def local_stack(bucket: str = "tiercache", s3_process: bool = False, cpus: set[int] | None = None):
    """redis-server and an S3 server with `bucket`, for the demo and benchmarks. The
    S3 server runs in this process's threads, or with `s3_process` in its own process
    (then `.stop()` of the yielded endpoint does nothing: it ends with the block).
    With `cpus` (only with `s3_process`), both servers run only on those CPUs."""
    if cpus and not s3_process:
        raise ValueError("local_stack: cpus needs s3_process=True (an in-process S3 server cannot be bound)")
    redis_server = RedisServer(cpus=cpus).start()
    try:
        if s3_process:
            with moto_process(bucket, cpus) as url:
                yield redis_server, S3Endpoint(url=url, server=None)
            return
        s3 = start_moto()
        try:
            create_bucket(s3.url, bucket)
            yield redis_server, s3
        finally:
            s3.stop()
    finally:
        redis_server.close()
