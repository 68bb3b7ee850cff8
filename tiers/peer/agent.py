"""One worker's NIXL agent: its CPU buffer and slot table registered for other
instances to read, and reads from theirs into its own slots. Bytes move only through
NIXL (UCX: RDMA, shared memory or TCP); Redis carries the agent's metadata.

Not thread-safe (the agent runs without NIXL's locking): PeerTier calls it under
one lock."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from tiercache.config import PEER_PORT_SPAN
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.peer.table import SlotTable

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
_POLL_SECONDS = 0.0002
# Microseconds NIXL's progress thread sleeps between passes. NIXL's Python API starts
# it with none: a thread that spins a whole core per worker, idle or not (0.98 of a
# core measured), which on a small host takes the forward's cores. A holder must keep
# progressing (UCX over TCP answers a read only when the holder progresses), so the
# thread stays, paced: at 100 us an idle agent used 0.02 of a core, and a peer read
# of 16-64 blocks took no longer than with the spinning thread.
PROGRESS_DELAY_US = 100
_CONFIG_SWAP = threading.Lock()


def load_nixl() -> ModuleType | None:
    """NIXL's Python module, or None (with a warning) where it cannot be imported."""
    try:
        import nixl_cu12 as nixl
    except Exception as error:  # ImportError, or a native library that fails to load
        log.warning(
            "tiercache: NIXL cannot be imported (%s: %s): the peer tier is off "
            "(install nixl-cu12 to read blocks from other instances)",
            type(error).__name__,
            error,
        )
        return None
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL logs every agent and backend it creates to stdout at INFO.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl


@dataclass(frozen=True)
class PeerRecord:
    """What a reader needs to reach one worker's CPU tier: its agent's NIXL metadata and
    where its regions lie in the holder's address space."""

    agent: str
    metadata: bytes
    data_base: int
    slot_bytes: int
    num_slots: int
    headers_base: int
    directory_base: int
    entries: int
    # Where operators find the worker (tiercache inspect --peers): peer.host, else the
    # machine's name, and the first port of its range (0: any port). Readers never use
    # them: NIXL's metadata carries the addresses UCX listens on.
    host: str = ""
    port: int = 0

    def layout(self) -> str:
        fields = {name: getattr(self, name) for name in _LAYOUT_FIELDS}
        return json.dumps({"version": LAYOUT_VERSION, **fields}, separators=(",", ":"))

    @classmethod
    def from_fields(cls, agent: bytes, metadata: bytes, layout: bytes) -> PeerRecord:
        """Raises ValueError (or KeyError/TypeError) on a record this version cannot read."""
        fields = json.loads(layout)
        if fields.get("version") != LAYOUT_VERSION:
            raise ValueError(f"peer layout version {fields.get('version')!r}")
        values: dict[str, Any] = {name: int(fields[name]) for name in _LAYOUT_FIELDS}
        return cls(agent=agent.decode(), metadata=metadata, **values)


_LAYOUT_FIELDS = (
    "data_base",
    "slot_bytes",
    "num_slots",
    "headers_base",
    "directory_base",
    "entries",
)


class TransferFailed(Exception):
    """A NIXL read that did not complete: the peer refused it, died, or was too late."""


@contextlib.contextmanager
def _ucx_settings(host: str | None, port: int) -> Iterator[None]:
    """UCX reads its settings from the environment when a backend is created: set the
    interface and port range for this agent only, unless the user set them."""
    wanted: dict[str, str] = {}
    if port:
        wanted["UCX_TCP_PORT_RANGE"] = f"{port}-{port + PEER_PORT_SPAN - 1}"
    if host:
        device = interface_of(host)
        if device:
            wanted["UCX_NET_DEVICES"] = device
        else:
            log.warning("tiercache: no network interface holds peer.host %s: using every interface", host)
    saved = {name: os.environ.get(name) for name in wanted}
    try:
        for name, setting in wanted.items():
            if saved[name] is None:
                os.environ[name] = setting
        yield
    finally:
        for name, before in saved.items():
            if before is None:
                os.environ.pop(name, None)


@contextlib.contextmanager
def _paced_progress(nixl: ModuleType, delay_us: int) -> Iterator[None]:
    """Agents made in this block get a progress thread that sleeps `delay_us` between
    passes. NIXL's Python wrapper sets its C++ config's pthrDelay to 0 with no way to
    pass another, so for the wrapper's call its config class is a subclass whose
    pthrDelay never goes below `delay_us` (swapped back at once, under a lock)."""
    bind: Any = getattr(getattr(nixl, "_api", None), "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or delay_us <= 0:
        yield  # another NIXL layout: its own default
        return
    raw = base.pthrDelay

    class PacedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return raw.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            raw.__set__(self, max(int(value), delay_us))

    with _CONFIG_SWAP:
        bind.nixlAgentConfig = PacedConfig
        try:
            yield
        finally:
            bind.nixlAgentConfig = base


def interface_of(host: str) -> str | None:
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address.split("%")[0] == host for address in addresses):
            return name
    return None


class NixlAgent:
    def __init__(
        self,
        nixl: ModuleType,
        name_hint: str,
        buffer: CpuBuffer,
        table: SlotTable,
        scratch_bytes: int,
        *,
        host: str | None = None,
        port: int = 0,
        progress_delay_us: int = PROGRESS_DELAY_US,
    ):
        self.buffer = buffer
        self.table = table
        self.host = host or socket.gethostname()
        self.port = port
        # Unique per process start: a restarted holder is a new agent to its readers.
        self.name = f"{name_hint}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        with _ucx_settings(host, port), _paced_progress(nixl, progress_delay_us):
            self._agent = nixl.nixl_agent(self.name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        # Where directory rows and headers read from peers land.
        self.scratch = torch.zeros(scratch_bytes, dtype=torch.uint8)
        self._registered = [
            self._agent.register_memory(tensor)
            for tensor in (buffer.tensor, table.headers, table.directory, self.scratch)
        ]
        self._remotes: set[str] = set()

    def record(self) -> PeerRecord:
        return PeerRecord(
            agent=self.name,
            metadata=self._agent.get_agent_metadata(),
            data_base=self.buffer.tensor.data_ptr(),
            slot_bytes=self.buffer.slot_bytes,
            num_slots=self.buffer.num_slots,
            headers_base=self.table.headers.data_ptr(),
            directory_base=self.table.directory.data_ptr(),
            entries=self.table.entries,
            host=self.host,
            port=self.port,
        )

    def connect(self, record: PeerRecord) -> None:
        if record.agent in self._remotes:
            return
        try:
            loaded = self._agent.add_remote_agent(record.metadata)
        except Exception as error:
            raise TransferFailed(f"cannot load the peer's NIXL metadata: {error}") from error
        name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if name != record.agent:
            self._forget(name)
            raise TransferFailed(f"the metadata names agent {name!r}, not {record.agent!r}")
        self._remotes.add(record.agent)

    def forget(self, agent: str) -> None:
        """Drop a peer: its connection closes, and whatever it still had in flight with it."""
        if agent in self._remotes:
            self._remotes.discard(agent)
            self._forget(agent)

    def _forget(self, agent: str) -> None:
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as error:  # a peer already gone: nothing left to close
            log.debug("tiercache: removing NIXL peer %s: %s", agent, error)

    def read(self, agent: str, pieces: Sequence[tuple[int, int, int]], deadline: float) -> None:
        """Read each (remote address, local address, length) from `agent` by `deadline`
        (time.monotonic()). Raises TransferFailed; on a late read the request is
        released and the peer dropped, so nothing more of it lands."""
        if not pieces:
            return
        table = np.asarray(pieces, dtype=np.uint64)
        remote = np.stack([table[:, 0], table[:, 2], np.zeros(len(table), np.uint64)], axis=1)
        local = np.stack([table[:, 1], table[:, 2], np.zeros(len(table), np.uint64)], axis=1)
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"),
                agent,
            )
        except Exception as error:
            raise TransferFailed(f"read refused: {type(error).__name__}: {error}") from error
        state = "ERR"
        try:
            state = self._agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
                state = self._agent.check_xfer_state(handle)
        except Exception as error:
            state = f"{type(error).__name__}: {error}"
        finally:
            self._release(handle, agent, done=state == "DONE")
        if state == "PROC":
            raise TransferFailed("the peer did not answer within the deadline")
        if state != "DONE":
            raise TransferFailed(f"read failed: {state}")

    def _release(self, handle, agent: str, done: bool) -> None:
        try:
            handle.release()
        except Exception as error:
            log.debug("tiercache: releasing a NIXL read from %s: %s", agent, error)
        if not done:
            self.forget(agent)

    def close(self) -> None:
        for agent in list(self._remotes):
            self.forget(agent)
        for descs in self._registered:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(descs)
        self._registered = []
