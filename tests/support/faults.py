"""Fault injection for the reliability tests: a TCP proxy on loopback that can be
stopped or slowed in front of Redis or S3, a vLLM engine process a test can drive
between prompts and SIGKILL, a three-master Redis Cluster, and a throwaway CA with a
server certificate for TLS. Everything listens on 127.0.0.1 only, and every wait is
bounded."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tiercache.ops.local_stack import _wait_port, free_port


class TcpProxy:
    """Forwards 127.0.0.1:port to 127.0.0.1:upstream_port.

    stop() closes the listener and cuts every open connection (the endpoint is down:
    connections are refused); start() listens again on the same port. `delay` seconds
    are slept before each chunk goes downstream (a slow endpoint)."""

    def __init__(self, upstream_port: int, port: int | None = None, delay: float = 0.0):
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self.delay = delay
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if self._thread is not None:
            self._thread.join(5)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)


def wait_for_file(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until `path` exists; fail early if `proc` ended first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({proc.returncode}) before {path.name} appeared")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


class EngineProcess:
    """tiercache.ops.vllm_runner in a session of its own, so a test can drive it
    between prompts ({"touch": ...}/{"wait_for": ...} entries) and kill the whole
    engine (front end, engine core, workers) with SIGKILL, as a crash would."""

    def __init__(self, spec: dict[str, Any], workdir: Path, env: dict[str, str] | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        stamp = f"{os.getpid()}-{time.monotonic_ns()}"
        self.spec_file = workdir / f"{stamp}.spec.json"
        self.out_file = workdir / f"{stamp}.out.json"
        self.log_file = workdir / f"{stamp}.log"
        self.spec_file.write_text(json.dumps(spec))
        child_env = {**os.environ, **(env or {})}
        child_env.setdefault("PYTHONHASHSEED", "0")
        self._log = open(self.log_file, "w")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache.ops.vllm_runner", str(self.spec_file), str(self.out_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )

    def wait_file(self, path: Path, timeout: float = 300) -> None:
        try:
            wait_for_file(path, timeout, self.proc)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{error}; log {self.log_file}:\n{self.log_tail()}") from None

    def log_tail(self, n: int = 6000) -> str:
        self._log.flush()
        return self.log_file.read_text(errors="replace")[-n:]

    def wait(self, timeout: float = 600) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._log.close()
        if self.proc.returncode != 0 or not self.out_file.exists():
            raise RuntimeError(f"engine failed (exit {self.proc.returncode}); log:\n{self.log_tail()}")
        self._kill_group()  # stray engine-core children of the os._exit()ed front end
        return json.loads(self.out_file.read_text())

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL every process of the engine at once."""
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        self._log.close()


class RedisClusterServers:
    """Three redis-server masters in cluster mode on loopback ports, joined with
    `redis-cli --cluster create`. kill(i) SIGKILLs one master."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000):
        for binary in ("redis-server", "redis-cli"):
            if shutil.which(binary) is None:
                raise RuntimeError(f"{binary} is not installed: run scripts/bootstrap.sh")
        self.ports = [free_port() for _ in range(masters)]
        self.bus_ports = [free_port() for _ in range(masters)]
        self.node_timeout_ms = node_timeout_ms
        self.dir = tempfile.mkdtemp(prefix="tiercache-cluster-")
        self.procs: list[subprocess.Popen | None] = [None] * masters

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> RedisClusterServers:
        for i, port in enumerate(self.ports):
            node_dir = Path(self.dir) / str(port)
            node_dir.mkdir()
            # The cluster bus defaults to port + 10000, which overflows for high ports.
            args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir)]
            args += ["--cluster-enabled", "yes", "--cluster-port", str(self.bus_ports[i])]
            args += ["--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", str(self.node_timeout_ms), "--save", "", "--appendonly", "no"]
            self.procs[i] = subprocess.Popen(
                ["redis-server", *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for port in self.ports:
            _wait_port(port)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()
        return self

    def _info(self, port: int) -> str:
        result = subprocess.run(
            ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=10
        )
        return result.stdout

    def wait_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p, proc in zip(self.ports, self.procs, strict=True) if proc is not None]
            if all("cluster_state:ok" in self._info(port) for port in live):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the cluster did not reach state ok within {timeout}s")

    def port_of_slot(self, slot: int) -> int:
        result = subprocess.run(
            ["redis-cli", "-p", str(self.ports[0]), "cluster", "slots"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        lines = result.stdout.split()
        # Triples of (start, end, ip, port, id) per range, flattened by redis-cli.
        for i in range(0, len(lines) - 3, 1):
            if lines[i].isdigit() and lines[i + 1].isdigit() and lines[i + 2] == "127.0.0.1":
                start, end, port = int(lines[i]), int(lines[i + 1]), int(lines[i + 3])
                if start <= slot <= end:
                    return port
        raise LookupError(f"no node serves slot {slot}")

    def kill(self, port: int) -> None:
        i = self.ports.index(port)
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.procs[i] = None

    def close(self) -> None:
        for port in list(self.ports):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost, written as
    PEM files: {"ca": ..., "cert": ..., "key": ...}."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tiercache test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": directory / "ca.pem", "cert": directory / "server.pem", "key": directory / "server.key"}
    files["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    files["key"].chmod(0o600)
    return files


def write_blocks_in_process(
    config_data: dict, shape_fields: dict, blocks: list[bytes], start, results
) -> None:
    """Child process body for "two engines store the same prefix at once": one
    TierEngine of its own (its own Redis and S3 clients) writes `blocks` through to S3
    once `start` (a multiprocessing.Event) is set, and puts (PUTs sent, stored flags)
    on `results`."""
    from tiercache.config import build_config
    from tiercache.engine import S3, ObjectShape, TierEngine
    from tiercache.tiers.cpu import CpuBuffer

    config = build_config(config_data, environ={})
    shape = ObjectShape(**shape_fields)
    engine = TierEngine(config, shape, CpuBuffer(1, shape.slot_bytes, pin_memory=False))
    puts: list[int] = []
    engine.s3.client.meta.events.register("before-send.s3.PutObject", lambda **_: puts.append(1))
    done: list = []
    try:
        start.wait(60)
        for block in blocks:
            engine.write_down(
                block, None, done.append, data=block_payload(block, shape.slot_bytes), tiers=(S3,)
            )
        engine.flush(120)
    finally:
        engine.close()
    results.put((len(puts), [bool(result.stored.get(S3)) for result in done]))


def block_payload(block: bytes, size: int) -> bytes:
    """Deterministic page bytes for a block hash, so a reader can tell right bytes."""
    import hashlib

    seed = hashlib.sha256(block).digest()
    return (seed * (size // len(seed) + 1))[:size]


class TlsRedisServer:
    """redis-server speaking TLS only (--port 0) with one ACL user and the default
    user switched off; clients need the CA to verify it, no client certificate."""

    def __init__(self, directory: Path, user: str, password: str):
        self.dir = Path(directory)
        self.files = make_tls_files(self.dir / "tls")
        self.port = free_port()
        self.user = user
        args = ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--tls-cert-file", str(self.files["cert"]), "--tls-key-file", str(self.files["key"])]
        args += ["--tls-ca-cert-file", str(self.files["ca"]), "--tls-auth-clients", "no"]
        acl = self.dir / "users.acl"
        acl.write_text(f"user default off\nuser {user} on >{password} ~tc:* &* +@all\n")
        acl.chmod(0o600)
        args += ["--aclfile", str(acl)]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        self.process = subprocess.Popen(
            ["redis-server", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_port(self.port)

    def url(self, password: str) -> str:
        return f"rediss://{self.user}:{password}@127.0.0.1:{self.port}/0"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
