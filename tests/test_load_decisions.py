"""Load only what beats recomputing it (connector/cost_model.py): the estimates, the
seeds that take every hit until both sides are measured, the cut at tier
boundaries, the re-measure of a tier judged slow, the decisions counted, and the
`movers.cost_model: off` switch. No vLLM: the scheduler is driven directly, and
through the stand-in engine of test_scheduler_reports with real workers timing real
disk loads and forwards."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from test_scheduler_reports import BLOCK, MiniEngine, make_scheduler, request, store

from tiercache.config import build_config, load_config
from tiercache.connector.cost_model import RECHECK_SECONDS, LinearEstimate, LoadCostModel
from tiercache.connector.forward_timer import ForwardTimer
from tiercache.connector.metadata import FILLED, FORWARD, RELEASED, TierCacheWorkerMetadata
from tiercache.tiers import CPU, DISK, PEER, S3

NO_DISK = "/tmp/tiercache-unit-disk-never-created"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the estimates -------------------------------------------------------------------
def test_an_estimate_separates_first_byte_from_the_rate_per_block():
    estimate = LinearEstimate()
    for blocks in (2, 4, 8, 16, 4, 2):
        estimate.add(blocks, 0.05 + 0.01 * blocks)
    fixed, per_block = estimate.fit()
    assert fixed == pytest.approx(0.05, abs=1e-6)
    assert per_block == pytest.approx(0.01, abs=1e-6)
    assert estimate.predict(100) == pytest.approx(1.05, abs=1e-4)


def test_an_estimate_of_one_size_leans_towards_loading():
    """Loads of 9 blocks only: the first byte cannot be told from the rate, so both go
    into the rate. A smaller load is then predicted cheaper than it is (taken), and a
    prefill of one size predicts a cost per token too high (loads look better)."""
    estimate = LinearEstimate()
    assert estimate.fit() is None and estimate.predict(9) is None
    for _ in range(5):
        estimate.add(9, 0.09)
    assert estimate.fit() == (0.0, pytest.approx(0.01))
    assert estimate.predict(3) == pytest.approx(0.03)


def test_an_estimate_follows_a_slowdown_after_one_load():
    estimate = LinearEstimate()
    for _ in range(20):
        estimate.add(9, 0.05)
    estimate.add(9, 2.0)  # the tier became 40x slower
    assert estimate.predict(9) > 0.4


# -- the decision ---------------------------------------------------------------------
def model(per_token: float | None = 0.001, **tiers: tuple[float, float]) -> LoadCostModel:
    """A cost model whose prefill costs `per_token` s a token, and each named tier
    `fixed + per_block x blocks` s (loads of 2 and 8 blocks observed)."""
    cost = LoadCostModel(Clock())
    if per_token is not None:
        cost.observe_forward(1000, 1000 * per_token)
    for tier, (fixed, per_block) in tiers.items():
        for blocks in (2, 8):
            cost.observe_load(tier, blocks, fixed + per_block * blocks)
    return cost


HIT = [CPU] * 3 + [DISK] * 2 + [S3] * 4  # recompute: 32 ms a block at 1 ms a token


def test_nothing_is_refused_before_both_sides_are_measured():
    assert model(per_token=None, disk=(5.0, 1.0), s3=(5.0, 1.0)).blocks_to_load(HIT, BLOCK) == 9
    assert model().blocks_to_load(HIT, BLOCK) == 9  # no tier measured yet: taken


def test_a_tier_whose_only_sample_was_rejected_counts_as_unmeasured():
    """A load of no blocks is no sample: the tier's estimate exists but has none, and
    its prediction (None) reached the comparison and raised TypeError in vLLM's
    scheduler before."""
    cost = model()
    cost.observe_load(DISK, 0, 0.5)
    assert cost.expected_load_seconds(DISK, 4) == 0.0
    assert cost.blocks_to_load(HIT, BLOCK) == 9


@pytest.mark.parametrize(
    ("disk", "s3", "loaded"),
    [
        ((0.001, 0.002), (0.01, 0.005), 9),  # both beat 32 ms a block: all of it
        ((0.001, 0.002), (1.0, 0.005), 5),  # S3's first byte costs more than its 4 blocks save
        ((1.0, 0.002), (0.01, 0.005), 3),  # disk too slow: S3 after it cannot be reached
        ((1.0, 0.002), (1.0, 0.005), 3),  # the CPU part is always loaded
    ],
)
def test_a_hit_is_cut_at_the_tier_boundary_that_saves_most(disk, s3, loaded):
    assert model(disk=disk, s3=s3).blocks_to_load(HIT, BLOCK) == loaded


def test_a_lower_tier_before_the_cpu_blocks_holds_them_back():
    assert model(disk=(1.0, 0.0)).blocks_to_load([DISK, CPU, CPU], BLOCK) == 0
    assert model(disk=(0.001, 0.0)).blocks_to_load([DISK, CPU, CPU], BLOCK) == 3


def test_a_tier_that_saves_less_than_it_costs_is_left_out_even_if_the_whole_prefix_saves():
    """Nine CPU blocks and one S3 block that costs two blocks' recompute: loading all
    ten still beats recomputing them, but nine save more."""
    cost = model(s3=(0.0, 0.064))
    assert cost.blocks_to_load([CPU] * 9 + [S3], BLOCK) == 9


def test_lower_tiers_stage_in_parallel():
    """Disk and S3 blocks of one hit are read at once: the slower tier's time counts,
    not the sum. Four disk blocks take 100 ms, four S3 blocks 150 ms, recomputing four
    128 ms: all eight save 106 ms (256 - 150); added up, they would save 6 ms, less
    than the disk blocks alone (28 ms)."""
    cost = model(disk=(0.0, 0.025), s3=(0.0, 0.0375))
    assert cost.blocks_to_load([DISK] * 4 + [S3] * 4, BLOCK) == 8


def test_one_tier_is_preferred_to_another_holding_the_same_blocks_only_when_expected_faster():
    """A peer's CPU tier against this instance's disk (connector/lookup.py)."""
    assert not LoadCostModel(Clock()).faster(PEER, DISK, 4)  # neither measured: disk stays
    assert model(disk=(0.0, 0.01)).faster(PEER, DISK, 4)  # the peer unmeasured: tried
    measured_both = model(disk=(0.002, 0.01), peer=(0.0, 0.02))
    assert not measured_both.faster(PEER, DISK, 4)
    assert measured_both.faster(DISK, PEER, 4)
    # A fixed cost against a per-block one: the answer turns with the size of the load.
    first_byte = model(disk=(0.0, 0.01), peer=(0.02, 0.001))
    assert not first_byte.faster(PEER, DISK, 1) and first_byte.faster(PEER, DISK, 8)


def test_a_tier_judged_slow_is_measured_again_after_a_while():
    cost = model(s3=(2.0, 0.0))
    assert cost.blocks_to_load([S3] * 9, BLOCK) == 0
    cost.clock.now += RECHECK_SECONDS + 1
    assert cost.blocks_to_load([S3] * 9, BLOCK) == 9  # one request re-measures it
    cost.loading(S3)  # ... which the scheduler notes when it plans the load
    assert cost.blocks_to_load([S3] * 9, BLOCK) == 0  # no other one meanwhile
    cost.observe_load(S3, 9, 0.01)  # S3 is fast again: the old samples are forgotten
    assert cost.tiers[S3].samples == 1
    assert cost.blocks_to_load([S3] * 9, BLOCK) == 9


# -- the scheduler: timings in, decisions out, counted -----------------------------------
def decisions(tier: str, decision: str) -> float:
    return (
        REGISTRY.get_sample_value("tiercache_load_decisions_total", {"tier": tier, "decision": decision}) or 0
    )


def timings(sched, *items) -> None:
    meta = TierCacheWorkerMetadata([], Counter(), list(items))
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta, finished_recving=set()))


def cpu_and_disk_hit(**config):
    """A scheduler holding blocks 0-1 in the CPU tier and 2-3 on disk."""
    sched = make_scheduler(tp=1, slots=8, disk={"path": NO_DISK}, **config)
    blocks = [bytes([i]) * 32 for i in range(4)]
    ops = store(sched, request("r0", blocks[:2]), [1, 2, 3]).stores
    meta = TierCacheWorkerMetadata([(0, FILLED, (op.block_hash, op.slot)) for op in ops], Counter())
    meta.reports += [(0, RELEASED, op.slot) for op in ops]
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta, finished_recving=set()))
    for block in blocks[2:]:
        sched.policy.on_disk[block] = None
    return sched, blocks


def alloc(sched, req, tokens: int) -> None:
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(10, 15)),)), tokens)


def test_a_slow_disk_is_skipped_and_the_skip_counted_once():
    sched, blocks = cpu_and_disk_hit()
    timings(sched, (FORWARD, 1000, 1.0), (DISK, 2, 0.5), (DISK, 8, 2.0))  # 1 ms a token; 250 ms a block
    skip, load = decisions(DISK, "skip"), decisions(CPU, "load")
    hit = request("r1", blocks)
    # vLLM may ask more than once: same answer, nothing counted until it acts.
    assert sched.get_num_new_matched_tokens(hit, 0) == (2 * BLOCK, False)  # the CPU part, at once
    assert sched.get_num_new_matched_tokens(hit, 0) == (2 * BLOCK, False)
    assert decisions(DISK, "skip") == skip
    alloc(sched, hit, 2 * BLOCK)
    assert decisions(DISK, "skip") == skip + 1 and decisions(CPU, "load") == load + 1
    assert sched.take_decisions() == Counter({(CPU, "load"): 1, (DISK, "skip"): 1})
    assert sched.take_decisions() == Counter()
    assert sched.stats["decision_skip_disk"] == 1


def test_a_fast_disk_is_loaded():
    sched, blocks = cpu_and_disk_hit()
    timings(sched, (FORWARD, 1000, 1.0), (DISK, 2, 0.002), (DISK, 8, 0.008))
    hit = request("r1", blocks)
    assert sched.get_num_new_matched_tokens(hit, 0) == (4 * BLOCK, True)
    alloc(sched, hit, 4 * BLOCK)
    assert sched.take_decisions() == Counter({(CPU, "load"): 1, (DISK, "load"): 1})


def test_cost_model_off_loads_everything():
    sched, blocks = cpu_and_disk_hit(movers={"cost_model": "off"})
    timings(sched, (FORWARD, 1000, 1.0), (DISK, 2, 0.5), (DISK, 8, 2.0))
    assert sched.cost is None
    assert sched.get_num_new_matched_tokens(request("r1", blocks), 0) == (4 * BLOCK, True)


def test_cost_model_off_as_yaml_and_environment_write_it(tmp_path):
    """YAML 1.1 reads a bare `off` as false, as docs/configuration.md writes it."""
    path = tmp_path / "c.yaml"
    path.write_text("movers:\n  cost_model: off\n")
    assert load_config(path, environ={}).movers.cost_model == "off"
    assert build_config({}, environ={"TIERCACHE_MOVERS__COST_MODEL": "off"}).movers.cost_model == "off"
    assert build_config({}, environ={}).movers.cost_model == "on"


def test_only_steps_that_compute_prompt_tokens_are_timed():
    sched = make_scheduler(tp=1, slots=8)
    req = request("r1", [b"a" * 32])
    meta = store(sched, req, [3, 4])
    assert meta.timed_tokens == req.num_tokens  # the prefill
    cached = SimpleNamespace(
        req_ids=["r1"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[33]
    )
    decode = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"r1": 1},
        total_num_scheduled_tokens=1,
    )
    assert sched.build_connector_meta(decode).timed_tokens == 0
    off = make_scheduler(tp=1, slots=8, movers={"cost_model": "off"})
    assert store(off, request("r2", [b"b" * 32]), [3, 4]).timed_tokens == 0


def test_the_forward_timer_times_from_binding_to_wait_for_save():
    timer = ForwardTimer(on_cuda=False)
    timer.begin(0)  # not a step to time
    timer.end()
    timer.begin(300)
    time.sleep(0.02)
    timer.end()
    ((tokens, seconds),) = timer.take()
    assert tokens == 300 and 0.02 <= seconds < 1
    assert timer.take() == []


# -- the stand-in engine: workers time real disk loads and forwards ---------------------
def run_disk_hits(tmp_path, disk_read_delay: float, forward_seconds: float, **movers):
    """Three prefixes of three blocks through a CPU tier of four slots, so the first
    two live on disk only; then the first again (a disk hit, loaded: nothing measured
    yet), then the second (decided on what that load and the forwards measured)."""
    engine = MiniEngine(
        tmp_path, tp=2, lag=0, cpu_slots=4, time_forwards=True, forward_seconds=forward_seconds, movers=movers
    )
    for worker in engine.workers:
        real = worker.engine.disk.get_into

        def slow_get_into(*args, real=real):
            time.sleep(disk_read_delay)
            return real(*args)

        worker.engine.disk.get_into = slow_get_into
    try:
        prefixes = [[bytes([p, b]) * 16 for b in range(3)] for p in range(3)]
        for i, p in enumerate([0, 1, 2, 0, 1]):
            engine.submit(f"r{i}", prefixes[p])
            engine.drain()
        return engine.sched, engine.loaded
    finally:
        engine.close()


def test_workers_measure_a_slow_disk_and_the_next_hit_from_it_is_recomputed(tmp_path):
    sched, loaded = run_disk_hits(tmp_path, disk_read_delay=0.1, forward_seconds=0.0)
    assert sched.cost.tiers[DISK].samples >= 2  # both ranks timed the first disk hit
    assert sched.cost.prefill.samples > 0
    assert sched.stats["decision_load_disk"] == 1 and sched.stats["decision_skip_disk"] == 1
    assert loaded[DISK] == 2 * 3  # the first disk hit, on both ranks; the second was computed


def test_workers_measure_a_disk_faster_than_the_forward_and_every_hit_is_loaded(tmp_path):
    sched, loaded = run_disk_hits(tmp_path, disk_read_delay=0.0, forward_seconds=0.3)
    assert sched.cost.tiers[DISK].samples >= 2 and sched.cost.prefill.samples > 0
    assert sched.stats["decision_load_disk"] == 2 and sched.stats["decision_skip_disk"] == 0
    assert loaded[DISK] == 2 * 2 * 3


def test_with_the_cost_model_off_a_slow_disk_is_still_loaded(tmp_path):
    sched, loaded = run_disk_hits(tmp_path, disk_read_delay=0.1, forward_seconds=0.0, cost_model="off")
    assert sched.cost is None and sched.stats["decision_load_disk"] == 2
    assert loaded[DISK] == 2 * 2 * 3
