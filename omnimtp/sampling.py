"""Token sampling as a pure function of logits, parameters and per-request generators.

Filtering follows transformers' logits warpers in the same order (temperature, then top-k, then
top-p), so a sampled distribution here is the distribution `generate(do_sample=True)` samples from.
Sampling itself is a Gumbel-max race (`argmax(probs / Exp(1))`), which is an exact draw from
`probs`; the exponential noise of each row comes from that row's own `torch.Generator`, so a row's
token depends only on its own logits and seed — never on which rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits of magnitude up to 1e30 still divide to finite float32 values above this.
MIN_SAMPLED_TEMPERATURE = 1e-5
# The most alternatives a request's token logprobs list (OpenAI's `top_logprobs` cap).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a token from logits.

    temperature: below `MIN_SAMPLED_TEMPERATURE` (0 included) means greedy (argmax); otherwise logits are
        divided by it. Dividing float32 logits by a temperature near 1e-38 overflows them to infinities, whose
        softmax is NaN; every sampled distribution that tiny is a one-hot of the argmax anyway.
    top_k: keep the k most likely tokens (None or 0: no limit).
    top_p: keep the smallest set whose probability reaches top_p (1.0: no limit).
    repetition_penalty: > 1 discourages tokens the request already generated, applied HF's way
        (`apply_repetition_penalty`) before any filtering and in greedy mode too (1.0: off). Only
        samplers that keep a per-request token history apply it (the talker loop does).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
                raise ValueError(f"top_k must be None or an integer >= 0, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not (0.0 < penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLED_TEMPERATURE

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0)


# Qwen3-Omni's thinker defaults: what `omnimtp speak --seed` and `omnimtp batch` sample with, and what an
# adaptive thinker's sampled draft costs are measured with.
QWEN3_OMNI_THINKER_SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)

# Qwen3-Omni's code predictor samples with these (hard-coded in transformers and vllm-omni).
QWEN3_OMNI_CODE_PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model: the log-softmax of the raw logits it was drawn from
    (before temperature, top-k and top-p: the model's own distribution, what OpenAI and vLLM report whatever the
    sampling), and the `top` most likely tokens' (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int = 0) -> TokenLogprob:
    """`TokenLogprob` of `token_id` from one row's logits [V] (any float dtype; computed in float32), with the
    num_top most likely tokens. A row's value depends on that row alone."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top = ()
    if num_top:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(int(token_id), float(logprobs[token_id]), top)


def check_num_logprobs(value, name: str = "logprobs") -> None:
    """ValueError naming `name` unless value is None (no logprobs) or an integer in [0, MAX_TOP_LOGPROBS] (the
    chosen token's logprob and that many alternatives)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' `RepetitionPenaltyLogitsProcessor` on a per-row set of seen tokens.

    logits: [B, V]; seen: [B, V] bool (True where the row already generated that token). A seen
    token's logit is divided by `penalty` when positive and multiplied by it when negative.
    Returns a new float32 tensor."""
    scores = logits.float()
    if penalty == 1.0:
        return scores.clone()
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p as transformers applies them; removed entries become -inf.

    logits: [..., V] (any float dtype; computed in float32). Returns a new float32 tensor.
    For greedy params the logits are returned unscaled (argmax is all that is used)."""
    scores = logits.float()
    if params.is_greedy:
        return scores.clone()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1.0 - params.top_p)
        sorted_remove[..., -1:] = False
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: [..., V] float32. Greedy gives a one-hot of argmax.

    Never NaN: scores that overflowed to +inf (huge logits) keep only the infinite entries, shared evenly,
    and a row with nothing left (every entry -inf or NaN) falls back to the argmax of its raw logits."""
    if params.is_greedy:
        return _one_hot(logits.argmax(-1), logits.shape[-1])
    scores = filter_logits(logits, params)
    probs = scores.softmax(dim=-1)
    # Branch-free (no host sync): a finite row's probabilities pass through untouched.
    is_bad = torch.isnan(probs).any(dim=-1, keepdim=True)
    is_top = scores == float("inf")
    top_probs = is_top.float() / is_top.sum(dim=-1, keepdim=True).clamp(min=1)
    raw_argmax = logits.float().nan_to_num(nan=float("-inf")).argmax(-1)
    fallback = torch.where(is_top.any(dim=-1, keepdim=True), top_probs, _one_hot(raw_argmax, logits.shape[-1]))
    return torch.where(is_bad, fallback, probs)


def _one_hot(ids: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, num_classes).float()


def exponential_noise(
    shape: tuple[int, ...], generators: list[torch.Generator] | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Exp(1) noise of shape [B, ...] in float32, row b drawn from generators[b] (or the default RNG)."""
    if generators is None:
        return torch.empty(shape, device=device).exponential_()
    if len(generators) != shape[0]:
        raise ValueError(f"generators must have one entry per row: got {len(generators)} for {shape[0]} rows")
    rows = [torch.empty(shape[1:], device=device).exponential_(generator=g) for g in generators]
    return torch.stack(rows)


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draw: probs [B, V], noise [B, V] ~ Exp(1) → token ids [B] (long)."""
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingParams | None, generators: list[torch.Generator] | None = None
) -> torch.Tensor:
    """Pick one token per row. logits [B, V] → [B] long. None params = greedy."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if params is None or params.is_greedy:
        return logits.argmax(dim=-1)
    probs = probs_from_logits(logits, params)
    noise = exponential_noise(tuple(probs.shape), generators, device=probs.device)
    return sample_from_probs(probs, noise)


_UINT64 = 1 << 64


def request_seeds(seed: int | None) -> tuple[int | None, int | None, int | None]:
    """The thinker's, the talker's and the codec's generator seeds of one omni request seeded `seed` (None:
    unseeded): 2·seed and 2·seed + 1 modulo 2^64, so any int64 seed (what OpenAI accepts) is valid and
    `manual_seed` never overflows; the codec's is splitmix64(seed mod 2^64), a bijection, so two requests'
    codec seeds never collide, moved off the request's own two seeds in the rare case it hits one (its
    top bit flipped keeps its parity: it then differs from both). Every driver (pipeline, server) seeds a
    request through this one rule."""
    if seed is None:
        return None, None, None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be None or an integer, got {seed!r}")
    thinker, talker = (2 * seed) % _UINT64, (2 * seed + 1) % _UINT64
    codec = _splitmix64(seed % _UINT64)
    if codec in (thinker, talker):
        codec ^= 1 << 63
    return thinker, talker, codec


def _splitmix64(value: int) -> int:
    """splitmix64's output function: a bijection of [0, 2^64) that scatters neighbouring seeds."""
    value = (value + 0x9E3779B97F4A7C15) % _UINT64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) % _UINT64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) % _UINT64
    return value ^ (value >> 31)


def row_seeds(seed, num_rows: int) -> list[int | None]:
    """One seed per row of a batch from a call's `seed`: None (every row unseeded), an int (row i gets
    seed + i) or one int / None per row. Every batched entry point (pipeline, speculative and plain
    decoding) reads its `seed` argument through this."""
    if seed is None:
        return [None] * num_rows
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + row for row in range(num_rows)]
    if not isinstance(seed, (list, tuple)):
        raise ValueError(f"seed must be None, an int, or one int/None per row ({num_rows}), got {seed!r}")
    seeds = list(seed)
    if len(seeds) != num_rows or any(s is not None and (isinstance(s, bool) or not isinstance(s, int)) for s in seeds):
        raise ValueError(f"seed must be None, an int, or one int/None per row ({num_rows}), got {seed!r}")
    return seeds


def make_generators(seeds: list[int | None], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per request; a None seed draws a fresh nondeterministic seed. An int seed may be any
    Python int: it is taken modulo 2^64 (the range `torch.Generator.manual_seed` accepts)."""
    generators = []
    for seed in seeds:
        g = torch.Generator(device=device)
        if seed is None:
            g.seed()
        else:
            g.manual_seed(int(seed) % _UINT64)
        generators.append(g)
    return generators
