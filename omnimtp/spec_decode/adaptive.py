"""Adaptive drafting: how many tokens the next speculative step drafts (k = 0 is a plain one-token step).

A step drafting k tokens costs c_k (`DraftCosts`, in units of a plain step: c_0 = 1) and emits in
expectation

    E_k = 1 + α + α² + ... + α^k        tokens,

where α is the request's acceptance of a draft given the drafts before it were accepted. The controller
keeps an estimate of α per request (an exponential moving average over the verified drafts: each
accepted draft and each first rejection is one observation; a draft after a rejection was not verified
and says nothing) and drafts the k that maximises E_k / c_k, expected tokens per unit of time — the
goodput rule of SmartSpec (Liu et al., "Optimizing Speculative Decoding for Serving LLMs Using Goodput",
2024), which vLLM's dynamic speculation follows, with one acceptance rate per request as there (one
number learns from every verified position, so a request drafting 1 token still learns whether 4 would
pay); EAGLE-2 and SGLang adapt a draft *tree* from draft confidences instead. A batch drafts one k for
all its rows: the one maximising Σ_rows E_k / c_k.

What a step costs depends on how many rows it runs: a (k+1)-row verify of one request is nearly free on a
memory-bound step, but at 16 rows the verify turns compute-bound and a step of 3 drafts can cost 3 plain
steps. So the costs are a `DraftCostTable`, one `DraftCosts` per batch-size bucket (1, 2, 4, 8, 16, ...:
powers of two), and each step decides with the costs of the bucket of the rows it runs now (the smallest
bucket holding them): a cohort that shrinks as its requests finish moves to smaller buckets and, where
drafting pays there, back to drafting — like vLLM's draft length per batch size and SGLang's step count
per batch size, but from measured costs.

Worked example, c = (1, 1.6, 2.0, 2.4) for k = 0..3. α = 0.9: E = 1, 1.9, 2.71, 3.44 → E/c = 1, 1.19,
1.36, 1.43: draft 3. α = 0.3: E/c = 1, 0.81, 0.70, 0.6: a plain step.

Lossless and repeatable whatever k does. Speculative sampling emits exactly the target's distribution for
any k fixed before the step's drafts are drawn, so k is chosen from the request's past verifications only:
never from the step's own draft or target probabilities (cutting a chain where the drafted token looks
unlikely to the drafter biases the output) and never from the clock. The costs are fixed before the run
(measured once per model by `calibrate` and frozen, or given), so a seeded request repeats exactly with
the same costs; greedy output is plain greedy's for any k.

The estimate starts at a prior: the acceptance the drafts had while the costs were measured (`calibrate`
observes it on the target's own continuation of its fixed prompt; `DraftCosts.acceptance`), 0.7 where the
costs were given without one. A drafter trained well for its target starts drafting at once where drafting
pays at its acceptance, at 16 rows as at one; with a fixed prior of 0.7 the omni demo thinker (acceptance
≈ 0.97 greedy) started its 16-row batches plain and its 96-token requests ended before the probes below had
moved the estimate past break-even.

No acceptance is observed while k = 0 wins; after a run of plain steps one step drafts anyway, a probe (a
fixed schedule, not a random one), so a request whose text turns predictable again gets its drafts back.
Probes run only at batch sizes where drafting pays at the prior. Where no k pays for a request with the
prior's acceptance (the demo LM at 16 rows), a probe would mostly confirm that, and each one also pays
the drafter's catch-up over every slot the plain steps skipped (at 16 rows, a few plain steps for a probe
dozens of steps in), so such a batch takes plain steps only. (A gate that let probes run where drafting
came within 10 % of paying at the prior was tried: calibration noise then let 16-row demo LM batches
probe and draft, 0.86× plain.)
A probe drafts the k with the best goodput among k >= 1 (on one row with cheap drafts often several
tokens, so it observes more than one position); it costs c_k and is expected to emit E_k tokens a row, so
it loses c_k - E_k plain steps, and probes are spaced so that this loss stays near `probe_budget` (1 %) of
the steps: `probe_interval` (4) plain steps apart where a probe costs nearly nothing, (c_k - E_k) /
probe_budget apart where it is dear. A step that drafts because
drafting wins starts the count over. A plain step of a speculative run is the plain loop's own step (the
drafter reads the slots it skipped with the next step that drafts), so falling back costs nothing but the
probes.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from omnimtp.spec_decode.cost_cache import read_costs, write_costs

AUTO = "auto"
DEFAULT_MAX_DRAFT_TOKENS = 6
DEFAULT_PRIOR = 0.7
PROBE_BUDGET = 0.01


@dataclass(frozen=True)
class DraftCosts:
    """step[k]: the cost of one speculative step that drafts k tokens (drafts, the (k+1)-row verify, the
    loop's own work) relative to a plain one-token step, k = 0..max_draft_tokens; step[0] = 1. source: where
    the numbers came from, "given", "measured" (`calibrate`) or "cached" (a measurement read back from
    `omnimtp.spec_decode.cost_cache`); acceptance: the drafts' acceptance observed while measuring (what a
    `DraftController` assumes of a request before it verified any of its drafts), None when unknown;
    neither is part of equality."""

    step: tuple[float, ...]
    source: str = field(default="given", compare=False)
    acceptance: float | None = field(default=None, compare=False)

    def __post_init__(self):
        step = tuple(self.step)
        if len(step) < 2 or any(isinstance(c, bool) or not isinstance(c, (int, float)) for c in step):
            raise ValueError(f"draft_costs.step must be >= 2 numbers (k = 0, 1, ...), got {self.step!r}")
        if any(not (0 < c < math.inf) for c in step) or step[0] != 1.0:
            raise ValueError(f"draft_costs.step must be finite positive numbers with step[0] == 1.0, got {self.step!r}")
        object.__setattr__(self, "step", tuple(float(c) for c in step))
        a = self.acceptance
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
            raise ValueError(f"draft_costs.acceptance must be None or a number in [0, 1], got {a!r}")

    @property
    def max_draft_tokens(self) -> int:
        return len(self.step) - 1

    @classmethod
    def from_seconds(cls, seconds: list[float], acceptance: float | None = None) -> DraftCosts:
        """seconds[k]: measured seconds of a step drafting k tokens → costs relative to seconds[0], made
        non-decreasing in k (drafting more is never cheaper; a noisy measurement must not say it is)."""
        costs = [1.0]
        for s in seconds[1:]:
            costs.append(max(s / seconds[0], costs[-1]))
        return cls(tuple(costs), source="measured", acceptance=acceptance)


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch-size buckets costs are measured at for batches up to max_batch_size: 1, 2, 4, ... up to
    the first power of two >= max_batch_size."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(2 * buckets[-1])
    return tuple(buckets)


@dataclass(frozen=True)
class DraftCostTable:
    """`DraftCosts` per batch-size bucket: by_batch = ((rows, costs), ...), rows increasing, every costs
    with the same max_draft_tokens. A batch of n rows decides with the smallest bucket >= n (the largest
    bucket above it): a bucket's costs were measured with at least the rows it is used for."""

    by_batch: tuple[tuple[int, DraftCosts], ...]

    def __post_init__(self):
        by_batch = tuple(self.by_batch)
        sizes = [rows for rows, _ in by_batch]
        if not by_batch or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"draft_costs: batch sizes must be integers >= 1, got {sizes!r}")
        if sizes != sorted(set(sizes)):
            raise ValueError(f"draft_costs: batch sizes must be increasing, got {sizes!r}")
        if any(not isinstance(costs, DraftCosts) for _, costs in by_batch):
            raise ValueError("draft_costs: every batch size needs a DraftCosts")
        if len({costs.max_draft_tokens for _, costs in by_batch}) != 1:
            raise ValueError("draft_costs: every batch size must have costs for the same number of drafts")
        object.__setattr__(self, "by_batch", by_batch)

    @classmethod
    def of(cls, costs: DraftCosts | DraftCostTable | Mapping[int, DraftCosts]) -> DraftCostTable:
        """A table from a table, one `DraftCosts` for every batch size, or {rows: DraftCosts}."""
        if isinstance(costs, DraftCostTable):
            return costs
        if isinstance(costs, DraftCosts):
            return cls(((1, costs),))
        if isinstance(costs, Mapping):
            return cls(tuple(sorted(costs.items(), key=lambda item: item[0] if isinstance(item[0], int) else 0)))
        raise ValueError(f"draft_costs must be a DraftCosts or a DraftCostTable, got {type(costs).__name__}")

    @property
    def max_draft_tokens(self) -> int:
        return self.by_batch[0][1].max_draft_tokens

    def for_batch(self, num_rows: int) -> DraftCosts:
        """The costs a step of num_rows rows decides with."""
        for rows, costs in self.by_batch:
            if rows >= num_rows:
                return costs
        return self.by_batch[-1][1]

    @property
    def acceptance(self) -> float:
        """The acceptance a request is assumed to have before any of its drafts were verified: the mean of
        what the buckets' measurements observed, DEFAULT_PRIOR where none did."""
        observed = [costs.acceptance for _, costs in self.by_batch if costs.acceptance is not None]
        return statistics.fmean(observed) if observed else DEFAULT_PRIOR

    def to_dict(self) -> dict[int, tuple[float, ...]]:
        """{rows: (c_0, c_1, ...)}: what `/metrics` and `--json` report."""
        return {rows: costs.step for rows, costs in self.by_batch}

    def sources(self) -> dict[int, str]:
        """{rows: "given" | "measured" | "cached"} (`DraftCosts.source`)."""
        return {rows: costs.source for rows, costs in self.by_batch}


def expected_tokens(acceptance: float, k: int) -> float:
    """E_k = 1 + α + ... + α^k (see the module docstring)."""
    return sum(acceptance**j for j in range(k + 1))


class DraftController:
    """Per-request acceptance estimates and the k of the next step (see the module docstring).

    num_rows: the rows of the run (requests); costs: frozen `DraftCosts` (the same at every batch size) or
    a `DraftCostTable` (per batch-size bucket); prior: the acceptance assumed before a position was ever
    verified (None: the costs' measured acceptance, `DraftCostTable.acceptance`); smoothing: the weight of
    one new verification in the moving average (0.05: about the last 20 verified drafts; sampled
    acceptance is noisy, and with 0.1 a short run of rejections sent well-drafting sampled requests to
    plain steps, slower than a fixed k); probe_interval: the fewest plain steps in a row before a
    probe; probe_budget: the share of the steps the probes' expected loss may take (see the
    module docstring)."""

    def __init__(self, costs: DraftCosts | DraftCostTable, num_rows: int, *, prior: float | None = None,
                 smoothing: float = 0.05, probe_interval: int = 4, probe_budget: float = PROBE_BUDGET):
        self.costs = DraftCostTable.of(costs)
        self.smoothing = smoothing
        self.probe_interval = probe_interval
        self.probe_budget = probe_budget
        if prior is None:
            prior = self.costs.acceptance
        self.prior = prior
        self.acceptance = [prior] * num_rows  # [B] α estimates
        self.num_plain_in_a_row = 0
        self._decided_for: tuple | None = None  # (the active rows' estimates, the costs) `_decision` is for
        self._decision = (0, 0, 0)

    @property
    def max_draft_tokens(self) -> int:
        return self.costs.max_draft_tokens

    def choose(self, active: list[bool], num_step_rows: int | None = None) -> int:
        """The number of drafts of the next step for the rows still generating (active[b]); num_step_rows:
        the rows the step's forward runs (the costs' batch size), the active ones when None."""
        rows = [self.acceptance[b] for b, is_active in enumerate(active) if is_active]
        if not rows:
            return 0
        costs = self.costs.for_batch(len(rows) if num_step_rows is None else num_step_rows)
        key = (tuple(rows), id(costs))  # a run of plain steps changes no estimate: decided once for it
        if key != self._decided_for:
            self._decided_for, self._decision = key, self._decide(rows, costs)
        k, probe, probe_spacing = self._decision
        if k == 0 and probe and self.num_plain_in_a_row >= probe_spacing:
            k = probe
        self.num_plain_in_a_row = self.num_plain_in_a_row + 1 if k == 0 else 0
        return k

    def _decide(self, rows: list[float], costs: DraftCosts) -> tuple[int, int, int]:
        """For the rows' estimates at these costs → (the k of best goodput, the k of a probe or 0 for none,
        the plain steps in a row before a probe)."""
        expected = [sum(expected_tokens(a, k) for a in rows) for k in range(len(costs.step))]
        goodput = [tokens / cost for tokens, cost in zip(expected, costs.step, strict=True)]
        k = max(range(len(goodput)), key=lambda i: (goodput[i], -i))  # ties: the fewer drafts
        if k > 0 or not self._drafting_pays_at_the_prior(costs):
            return k, 0, 0
        # a probe drafts the k that pays best among k >= 1; its expected loss in plain steps is what its step
        # costs beyond the tokens it is expected to emit (per row, as a plain step emits one), and probes are
        # spaced so that they spend about probe_budget of the steps
        probe = max(range(1, len(goodput)), key=lambda i: (goodput[i], -i))
        loss = max(costs.step[probe] - expected[probe] / len(rows), 0.0)
        return 0, probe, max(self.probe_interval, math.ceil(loss / self.probe_budget))

    def _drafting_pays_at_the_prior(self, costs: DraftCosts) -> bool:
        """Whether some k >= 1 beats a plain step for a request at the prior acceptance: where none does, a
        typical request's drafts do not pay at this batch size and a probe would only confirm it."""
        return any(expected_tokens(self.prior, k) > cost for k, cost in enumerate(costs.step) if k > 0)

    def keep_rows(self, rows: list[int]) -> None:
        """The batch keeps only rows `rows` (in that order): their estimates follow them."""
        self.acceptance = [self.acceptance[b] for b in rows]

    def update(self, num_drafted: int, num_accepted: list[int], active: list[bool]) -> None:
        """After verifying num_drafted drafts per row: num_accepted[b] of row b's were accepted."""
        beta = self.smoothing
        for b, is_active in enumerate(active):
            if not is_active:
                continue
            # verified drafts: accepted ones + the first rejection
            for i in range(min(num_accepted[b] + 1, num_drafted)):
                observed = 1.0 if i < num_accepted[b] else 0.0
                self.acceptance[b] += beta * (observed - self.acceptance[b])


class FixedDrafts:
    """The controller of a fixed k: every step drafts k tokens."""

    def __init__(self, num_draft_tokens: int):
        self.max_draft_tokens = num_draft_tokens

    def choose(self, active: list[bool], num_step_rows: int | None = None) -> int:
        return self.max_draft_tokens

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def update(self, num_drafted: int, num_accepted: list[int], active: list[bool]) -> None:
        pass


def check_num_draft_tokens(value, name: str = "num_draft_tokens") -> None:
    """ValueError unless value is an int >= 1 or "auto"."""
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 or 'auto', got {value!r}")


_CALIBRATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {key: DraftCosts}


CALIBRATION_CYCLES = 16


def calibration_cycle(max_draft_tokens: int) -> tuple[list[int], list[bool]]:
    """The steps of one calibration cycle: (the k of each step, whether it is timed). Two plain steps, a
    step of one draft that is not timed (it reads the slots the plain steps skipped, what a run's first
    drafting step after plain ones pays), then one step of each k = 1..K."""
    ks = [0, 0, 1, *range(1, max_draft_tokens + 1)]
    return ks, [k != 1 or i != 2 for i, k in enumerate(ks)]


def calibrate(
    model, key: tuple, time_cycle: Callable[[list[int]], list[tuple[float, int, int]]], max_draft_tokens: int,
    fingerprint: Callable[[], dict] | None = None,
) -> DraftCosts:
    """Costs measured once per (model, key) and then frozen: time_cycle(ks) runs one step drafting ks[i]
    tokens after the other (a `calibration_cycle`: on one run, so that a drafting step follows the steps
    before it as in a run; a fresh run may start with a cycle) and returns for each step its seconds, the
    drafts it accepted and the drafts it verified (accepted ones and each row's first rejection). Each k
    is timed once per cycle, CALIBRATION_CYCLES cycles, and a k's cost is the median of its steps over the
    median of the plain steps: step by step, neighbouring steps see the machine alike, so a drift of its
    speed moves every k together (timing each k for several steps in a row instead gave c_4 / c_3 of 1.24
    to 1.41 on one model from one calibration to the next; step by step, 1.33 to 1.36). The accepted
    over the verified drafts of the timed drafting steps is the costs' `acceptance`. fingerprint: where given, what
    makes the `cost_cache.cost_fingerprint` of the measurement (called only when the costs are not in
    this process yet): costs kept on disk for it are used instead of measuring (source "cached"), and a
    measurement is kept there."""
    cache = _CALIBRATED.setdefault(model, {})
    key = (*key, max_draft_tokens)
    if key not in cache:
        on_disk = None if fingerprint is None else fingerprint()
        costs = None if on_disk is None else _cached_costs(on_disk, max_draft_tokens)
        if costs is None:
            ks, is_timed = calibration_cycle(max_draft_tokens)
            seconds: list[list[float]] = [[] for _ in range(max_draft_tokens + 1)]
            accepted = verified = 0
            for _ in range(CALIBRATION_CYCLES):
                steps = time_cycle(ks)
                if len(steps) != len(ks):
                    raise RuntimeError(f"calibration: {len(steps)} steps timed for a cycle of {len(ks)}")
                for k, timed, (step_seconds, step_accepted, step_verified) in zip(ks, is_timed, steps, strict=True):
                    if timed:
                        seconds[k].append(step_seconds)
                    if timed and k > 0:
                        accepted, verified = accepted + step_accepted, verified + step_verified
            costs = DraftCosts.from_seconds(
                [statistics.median(per_k) for per_k in seconds], acceptance=accepted / verified if verified else None
            )
            if on_disk is not None:
                write_costs(on_disk, costs.step, costs.acceptance)
        cache[key] = costs
    return cache[key]


class ScheduledDrafts:
    """The controller of a calibration run: step i drafts ks[i] tokens; `step_starts` records when each
    step began (its `choose`), so step i took step_starts[i + 1] - step_starts[i], and `counts` the drafts
    each drafting step accepted and verified."""

    def __init__(self, ks: list[int]):
        self.ks = list(ks)
        self.max_draft_tokens = max(self.ks)
        self.step_starts: list[float] = []
        self.counts: list[tuple[int, int]] = []

    def choose(self, active: list[bool], num_step_rows: int | None = None) -> int:
        self.step_starts.append(time.perf_counter())
        k = self.ks[len(self.step_starts) - 1]
        if k == 0:
            self.counts.append((0, 0))
        return k

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def update(self, num_drafted: int, num_accepted: list[int], active: list[bool]) -> None:
        accepted = [a for a, is_active in zip(num_accepted, active, strict=True) if is_active]
        self.counts.append((sum(accepted), sum(min(a + 1, num_drafted) for a in accepted)))


def _cached_costs(fingerprint: dict, max_draft_tokens: int) -> DraftCosts | None:
    """Costs on disk for the fingerprint, None when there are none or they are not what `calibrate` measures
    (valid, one per k up to max_draft_tokens, non-decreasing)."""
    entry = read_costs(fingerprint)
    if entry is None:
        return None
    steps, acceptance = entry
    if len(steps) != max_draft_tokens + 1 or steps != sorted(steps):
        return None
    try:
        return DraftCosts(tuple(steps), source="cached", acceptance=acceptance)
    except ValueError:
        return None


def acceptance_warning(stats) -> str | None:
    """A one-line warning when a run's acceptance did not pay for its drafts (None when it did): a fixed k
    whose τ stayed below 1 + k/2 (on CPU a step of k drafts costs about that many plain steps and more), or
    an adaptive run that fell back to plain steps in most of its steps."""
    tau = stats.mean_acceptance_length
    if stats.num_row_steps == 0:
        return None
    if stats.is_adaptive:
        plain = stats.draft_histogram.get(0, 0) / max(stats.num_steps, 1)
        if plain < 0.5:
            return None
        return (f"warning: speculation paid in few steps (τ {tau:.2f}; {plain:.0%} of steps fell back to plain "
                "decoding): the MTP head rarely agrees with the target; train it on the target's own outputs")
    k = stats.num_draft_tokens
    if tau >= 1 + k / 2:
        return None
    return (f"warning: τ {tau:.2f} at k = {k} is too low for speculation to pay (a step of {k} drafts costs about "
            f"{1 + k / 2:.1f} plain steps or more): use -k auto (drafts only while they pay), a smaller k, or a "
            "better-trained MTP head")
