"""Load only what beats recomputing it.

On a fast accelerator a lower tier can be slower to read than the prefill it saves:
users of other caches measured a file-tier hit at 2450 ms against 1725 ms of
recompute. The scheduler therefore asks this model, per request, how much of a hit
to load. Everything here is measured on the running engine:

- each lower tier's load time for n blocks, `first byte + n x per block`, fitted to
  the loads the workers timed (from the plan reaching the worker to the tier's last
  block staged, which is what the waiting request sees);
- the engine's cost per prompt token, fitted to the forwards of steps that computed
  prompt tokens (seconds against the tokens the step computed).

Every estimate leans towards loading while it knows little: an unmeasured tier costs
nothing, an unmeasured prefill costs infinitely much, and with samples of one size
only the fixed cost is folded into the per-unit one (a cost per token too high, a
tier's first byte counted as free below that size). So a cold start never refuses a
good hit, and a tier is refused only once both its loads and the prefill it competes
with have been measured. A tier judged too slow is not read again, so its estimate
could never recover: once nothing has refreshed it for RECHECK_SECONDS, one request
loads from it again, and that load starts the tier's estimate afresh (what was
measured before is that old).

The same estimates choose between two tiers that hold the same blocks: a peer's CPU
tier and this instance's disk (lookup.py), whichever is expected to load them sooner.

No vLLM here: the scheduler and the unit tests drive it directly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from tiercache.tiers import CPU

# A sample's weight relative to the one after it: the newest load counts for about a
# quarter of an estimate, so one load 20x slower than the ones before makes the
# estimate about 6x slower (and a load after a quiet spell, RECHECK_SECONDS, counts
# alone).
DECAY = 0.75
# How long a tier's estimate stands without a new load before one request re-measures
# it (at most one such load per tier per interval); samples older are forgotten.
RECHECK_SECONDS = 30.0
# Below this spread of sizes (relative to their mean) a fixed and a per-unit cost
# cannot be told apart, and the per-unit cost takes both.
MIN_RELATIVE_SPREAD = 0.1


class LinearEstimate:
    """seconds = fixed + per_unit x units, fitted by least squares to the samples,
    each older sample weighing DECAY times less than the one after it."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds < 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + units
        self._y = self._y * d + seconds
        self._xx = self._xx * d + units * units
        self._xy = self._xy * d + units * seconds
        self.samples += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit), or None before the first sample."""
        if not self.samples:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = max(self._xx / self._w - mean_x * mean_x, 0.0)
        if var > (MIN_RELATIVE_SPREAD * mean_x) ** 2:
            per_unit = (self._xy / self._w - mean_x * mean_y) / var
            fixed = mean_y - per_unit * mean_x
            if per_unit > 0 and fixed >= 0:
                return fixed, per_unit
        # One size seen (or a fit that makes no physical sense): all of it per unit.
        return 0.0, mean_y / mean_x

    def predict(self, units: float) -> float | None:
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_unit = fitted
        return fixed + per_unit * units


class LoadCostModel:
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.tiers: dict[str, LinearEstimate] = {}
        self.prefill = LinearEstimate()
        self._sampled_at: dict[str, float] = {}  # tier -> when its last load was measured
        self._fresh_at: dict[str, float] = {}  # ... or, if later, a load from it planned

    # -- what the workers measured -----------------------------------------------------
    def observe_load(self, tier: str, blocks: int, seconds: float) -> None:
        now = self.clock()
        if tier not in self.tiers or now - self._sampled_at[tier] > RECHECK_SECONDS:
            self.tiers[tier] = LinearEstimate()
        self.tiers[tier].add(blocks, seconds)
        self._sampled_at[tier] = self._fresh_at[tier] = now

    def observe_forward(self, tokens: int, seconds: float) -> None:
        self.prefill.add(tokens, seconds)

    def loading(self, tier: str) -> None:
        """A load from `tier` was planned: it will refresh the estimate, so no other
        request needs to re-measure the tier meanwhile."""
        if tier in self.tiers:
            self._fresh_at[tier] = self.clock()

    # -- the decision ----------------------------------------------------------------------
    def expected_load_seconds(self, tier: str, blocks: int) -> float:
        """0 for the CPU tier, an unmeasured tier, or one due for a re-measure."""
        estimate = self.tiers.get(tier)
        if tier == CPU or estimate is None or self.clock() - self._fresh_at[tier] > RECHECK_SECONDS:
            return 0.0
        predicted = estimate.predict(blocks)
        return 0.0 if predicted is None else predicted  # None: no sample yet, so unmeasured

    def faster(self, tier: str, than: str, blocks: int) -> bool:
        """Whether `blocks` blocks are expected to load from `tier` sooner than from
        `than`. An unmeasured tier (or one due for a re-measure) counts as free, so
        each is tried, and measured, before the other is preferred to it for good; on
        a tie (both unmeasured) `than` keeps its place."""
        return self.expected_load_seconds(tier, blocks) < self.expected_load_seconds(than, blocks)

    def blocks_to_load(self, tiers: Sequence[str], block_size: int) -> int:
        """How many blocks of a hit to load: `tiers` names the tier of each block of
        the hit, in prefix order. The hit is cut only where the tier changes, so what
        is loaded stays one whole prefix of whole tier runs. Of those cut points, the
        one that saves the most expected time wins (the longer on a tie): the prefix's
        recompute time less its load time. Lower tiers stage in parallel, so a
        prefix's load time is its slowest tier's; CPU blocks copy in the step itself.
        A prefix with no lower tier saves all its recompute, so a CPU hit is always
        loaded."""
        fitted = self.prefill.fit()
        if fitted is None:
            return len(tiers)
        per_token = fitted[1]
        best, best_saving = 0, 0.0
        blocks: Counter = Counter()
        for end, tier in enumerate(tiers, start=1):
            blocks[tier] += 1
            if end < len(tiers) and tiers[end] == tier:
                continue
            saving = self._saving(blocks, end * block_size * per_token)
            if saving >= best_saving:
                best, best_saving = end, saving
        return best

    def blocks_to_load_by_prefix(self, tiers: Sequence[str], block_size: int) -> list[int]:
        """`blocks_to_load` of every prefix of `tiers` in one pass: the m-th answer is
        that of the first m blocks. A hit cut back to fit the CPU tier asks it of
        many prefixes."""
        fitted = self.prefill.fit()
        if fitted is None:
            return list(range(1, len(tiers) + 1))
        per_token = fitted[1]
        answers = []
        best, best_saving = 0, 0.0  # of the cut points inside the prefixes still to come
        blocks: Counter = Counter()
        for end, tier in enumerate(tiers, start=1):
            blocks[tier] += 1
            saving = self._saving(blocks, end * block_size * per_token)
            answers.append(end if saving >= best_saving else best)  # a prefix may end here
            if end < len(tiers) and tiers[end] != tier and saving >= best_saving:
                best, best_saving = end, saving
        return answers

    def _saving(self, blocks: Counter, recompute_seconds: float) -> float:
        """What loading a prefix of these blocks per tier saves over computing it."""
        load = max((self.expected_load_seconds(t, n) for t, n in blocks.items()), default=0.0)
        return recompute_seconds - load
