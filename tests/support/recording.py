"""A TierCacheConnector that writes down every call vLLM makes to it, for the replay of
vLLM's call order against the worker half without vLLM (tests/support/replay.py).

Load it in place of the connector:

    {"kv_connector": "RecordingTierCacheConnector",
     "kv_connector_module_path": "support.recording", ...}

with RECORD_TIERCACHE_CALLS_TO (a folder) set in the engine's environment. Each
connector instance appends JSON lines to a file of its own in that folder:
`scheduler.jsonl` from the engine core, `worker-rank<N>.jsonl` from each worker. The
connector's behaviour is unchanged; the recorder only looks.

The scheduler half stamps each step's metadata with the step's number and writes
what vLLM scheduled in it (requests, the block tables, their block hashes, whether the
step has synchronous loads), from which scripts/record_connector_calls.py works out
which blocks each step's forward reads and writes. The workers write each call as it
comes, with its arguments and results. Block hashes are written in hex; the script
turns them into small numbers."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from tiercache.connector.connector import TierCacheConnector
from tiercache.connector.metadata import BlockOp, TierCacheMetadata

# Not TIERCACHE_*: those names are configuration overrides (tiercache/config.py).
RECORD_DIR_ENV = "RECORD_TIERCACHE_CALLS_TO"
STEP_ATTR = "recorded_step"  # set on each step's TierCacheMetadata by the scheduler half


def _hex(value: Any) -> str:
    return bytes(value).hex()


def op_json(op: BlockOp) -> list:
    return [_hex(op.block_hash), op.gpu_block, op.slot, op.tier]


def meta_json(meta: TierCacheMetadata) -> dict[str, Any]:
    return {
        "step": getattr(meta, STEP_ATTR, None),
        "write_backs": [[_hex(h), slot] for h, slot in meta.write_backs],
        "loads": [
            {"req": job.req_id, "async": job.is_async, "ops": [op_json(op) for op in job.ops]}
            for job in meta.loads
        ],
        "stores": [op_json(op) for op in meta.stores],
        "idle": meta.idle,
        "timed_tokens": getattr(meta, "timed_tokens", 0),
    }


def report_json(value: Any) -> Any:
    """A worker report's value: (block hash, slot), a slot, or a block hash."""
    if isinstance(value, tuple):
        return [_hex(value[0]), value[1]]
    if isinstance(value, bytes | bytearray):
        return _hex(value)
    return value


class _Log:
    def __init__(self, name: str):
        folder = Path(os.environ[RECORD_DIR_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / f"{name}.jsonl", "a", buffering=1)  # noqa: SIM115 (lives as long as the connector)
        self._lock = threading.Lock()

    def write(self, **entry: Any) -> None:
        line = json.dumps(entry, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


class RecordingTierCacheConnector(TierCacheConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        if self.scheduler is not None:
            self._log = _Log("scheduler")
            self._step = 0
            self._requests: dict[str, Any] = {}  # req id -> vLLM's Request
            self._tables: dict[str, list[int]] = {}  # req id -> its block ids, as vLLM keeps them
            self._since_step: list[dict[str, Any]] = []  # lookups and finishes before the next step
        else:
            assert self.worker is not None  # one half or the other
            self._log = _Log(f"worker-rank{self.worker.tp_rank}")

    # -- scheduler half -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._requests[request.request_id] = request
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        lookup = {"lookup": request.request_id, "computed": num_computed_tokens, "tokens": tokens}
        self._since_step.append({**lookup, "async": is_async})
        return tokens, is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request, block_ids: list[int]):
        delay, params = super().request_finished(request, block_ids)
        self._since_step.append({"request_finished": request.request_id, "delay_free": delay})
        return delay, params

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        self._step += 1
        setattr(meta, STEP_ATTR, self._step)
        requests = []
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids[0])
            requests.append(self._scheduled(new.req_id, new.num_computed_tokens, scheduler_output))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._tables[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self._tables.setdefault(req_id, []).extend(new_ids[0])
            requests.append(self._scheduled(req_id, cached.num_computed_tokens[i], scheduler_output))
        for req_id in scheduler_output.finished_req_ids:
            self._tables.pop(req_id, None)
            self._requests.pop(req_id, None)
        self._log.write(
            step=self._step,
            sync_loads=bool(getattr(scheduler_output, "has_sync_kv_loads", False)),
            tokens=scheduler_output.total_num_scheduled_tokens,
            requests=requests,
            finished=sorted(scheduler_output.finished_req_ids),
            preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            resumed=sorted(cached.resumed_req_ids),
            events=self._since_step,
            meta=meta_json(meta),
        )
        self._since_step = []
        return meta

    def _scheduled(self, req_id: str, computed: int, scheduler_output) -> dict[str, Any]:
        request = self._requests.get(req_id)
        assert self.scheduler is not None  # a scheduler-side call
        hashes = [_hex(h) for h in self.scheduler._block_keys(request)] if request is not None else []
        return {
            "req": req_id,
            "computed": computed,
            "tokens": scheduler_output.num_scheduled_tokens.get(req_id, 0),
            "blocks": list(self._tables.get(req_id, [])),
            "hashes": hashes,
        }

    # -- worker half ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        assert self.worker is not None  # a worker-side call
        self._log.write(
            call="register_kv_caches",
            layers={
                name: {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype)}
                for name, t in kv_caches.items()
            },
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            slot_bytes=self.slot_bytes,
            cpu_slots=self.worker.buffer.num_slots if self.worker.buffer is not None else 0,
            tp_rank=self.worker.tp_rank,
            tp_size=self.tp_size,
        )

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._log.write(call="handle_preemptions", step=getattr(kv_connector_metadata, STEP_ATTR, None))
        super().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, TierCacheMetadata) and self.worker is not None:
            self._log.write(call="bind", meta=meta_json(connector_metadata))

    def clear_connector_metadata(self) -> None:
        if self.worker is not None:
            self._log.write(call="clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._log.write(call="start_load_kv")
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log.write(call="wait_for_layer_load", layer=layer_name)
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._log.write(call="save_kv_layer", layer=layer_name)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._log.write(call="wait_for_save")
        super().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving = super().get_finished(finished_req_ids)
        if self.worker is not None:
            self._log.write(
                call="get_finished",
                finished_req_ids=sorted(finished_req_ids),
                sending=sorted(sending) if sending is not None else None,
                recving=sorted(recving) if recving is not None else None,
            )
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = super().get_block_ids_with_load_errors()
        if self.worker is not None:
            self._log.write(call="get_block_ids_with_load_errors", result=sorted(failed))
        return failed

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if self.worker is not None:
            counts = {} if stats is None else {k: v for k, v in stats.data.items() if isinstance(v, int)}
            self._log.write(call="get_kv_connector_stats", counts=counts)
        return stats

    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        if self.worker is not None:
            self._log.write(
                call="build_connector_worker_meta",
                reports=None
                if meta is None
                else [[rank, kind, report_json(value)] for rank, kind, value in meta.reports],
                hits=None if meta is None else dict(meta.hits),
            )
        return meta

    def shutdown(self) -> None:
        if self.worker is not None:
            self._log.write(call="shutdown")
        super().shutdown()
        self._log.close()
