"""Sampled decoding end to end on tiny models of each family (GLM-4.5, GLM-5, the hybrid Qwen3-Next / Qwen3.5 /
Qwen3.5-MoE): plain sampling and speculative sampling with a deliberately bad drafter both give the target's
exact law of the first three tokens, computed here independently (prefill then one-token decode steps, as
`generate` runs the model) with transformers' logits warpers (temperature → top-k → top-p). The test also
computes, for each plausible bug — recovering from p instead of max(p − q, 0), accepting every draft,
accepting with min(1, q/p), top-p before top-k, temperature last, a bonus from the wrong position — the law
it would give, and checks that it lies beyond twice the sample-size bound, so none of them can pass."""

from __future__ import annotations

import pytest
import torch
from distribution_checks import assert_law
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omnimtp import SamplingParams, plain_generate, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.spec_decode.proposer import TargetProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLING = SamplingParams(temperature=0.8, top_k=10, top_p=0.7)
# The drafter: the target itself, unfiltered and much too sharp (temperature 0.3): it is accepted about 85%
# of the time, so both the accepted and the recovered paths carry weight.
DRAFT_SAMPLING = SamplingParams(temperature=0.3)
NUM_ROWS = 8000
NUM_TOKENS = 3
PROMPT = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1))


FAMILIES = ["glm4_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm_moe_dsa"]
BATCH_ROWS = 4000  # rows per speculative_generate call (the hybrids' verify pads each row's block to 64 tokens)


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_lm(request.param, seed=0)


class SharpDraft:
    """A Proposer that drafts from the target at DRAFT_SAMPLING, whatever the run's sampling is (the target's
    own cache, cropped: glm4_moe; other families draft the same from `TableDraft`)."""

    def __init__(self, target):
        self.inner = TargetProposer(target)

    def reset(self):
        self.inner.reset()

    def propose(self, block, num_draft_tokens, sampling, generators):
        return self.inner.propose(block, num_draft_tokens, DRAFT_SAMPLING, generators)


def _warped(logits: torch.Tensor, params: SamplingParams, order: str = "tkp") -> torch.Tensor:
    """transformers' warpers in `order` (t: temperature, k: top-k, p: top-p) → probs [..., V] float64."""
    steps = {
        "t": TemperatureLogitsWarper(params.temperature) if params.temperature != 1.0 else None,
        "k": TopKLogitsWarper(params.top_k) if params.top_k else None,
        "p": TopPLogitsWarper(params.top_p) if params.top_p < 1.0 else None,
    }
    warpers = LogitsProcessorList([steps[name] for name in order if steps[name] is not None])
    return warpers(None, logits.double().clone()).softmax(dim=-1)


def _logits_table(target) -> dict[int, torch.Tensor]:
    """Target logits after PROMPT + every prefix of length n ≤ 2: {n: [V^n, V]} (row = the prefix's code)."""
    vocab = target.config.vocab_size
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V², 2]
    return {0: _next_logits(target, PROMPT[:, :0]), 1: _next_logits(target, torch.arange(vocab)[:, None]),
            2: _next_logits(target, pairs)}


class TableDraft:
    """A Proposer drafting what SharpDraft drafts (the target at DRAFT_SAMPLING) from a table of the target's
    logits after PROMPT + each short prefix (uniform past the table): rows of one prompt only, no forward."""

    def __init__(self, table: dict[int, torch.Tensor]):
        self.table = table
        self.reset()

    def reset(self):
        self.history = None

    def propose(self, block, num_draft_tokens, sampling, generators):
        from omnimtp.spec_decode.proposer import _draw

        batch_size, width = block.input_ids.shape
        vocab = self.table[0].shape[-1]
        block_mask = block.kv_mask[:, -width:]
        if self.history is None:  # the prompt block: the table starts after it
            self.history = [[] for _ in range(batch_size)]
        else:
            for row in range(batch_size):
                self.history[row] += block.input_ids[row][block_mask[row] == 1].tolist()
        prefixes = [h + [int(block.next_ids[row, block.last_index[row]])] for row, h in enumerate(self.history)]
        draft_tokens, draft_probs = [], []
        for _ in range(num_draft_tokens):
            logits = torch.zeros(batch_size, vocab, dtype=torch.float64)
            for row, prefix in enumerate(prefixes):
                if len(prefix) in self.table:
                    code = sum(t * vocab ** (len(prefix) - 1 - i) for i, t in enumerate(prefix))
                    logits[row] = self.table[len(prefix)][code]
            token, probs = _draw(logits.float(), DRAFT_SAMPLING, generators)
            draft_tokens.append(token)
            draft_probs.append(probs)
            prefixes = [prefix + [int(t)] for prefix, t in zip(prefixes, token, strict=True)]
        return torch.stack(draft_tokens, dim=1), torch.stack(draft_probs, dim=1)


def _next_logits(target, prefixes: torch.Tensor) -> torch.Tensor:
    """Target logits after PROMPT + each prefix, as `generate` computes them (the prompt in one forward, then
    one token per forward): prefixes [M, n] → [M, V]."""
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        logits = target(PROMPT.expand(prefixes.shape[0], -1), cache=cache).logits[:, -1]
        for t in range(prefixes.shape[1]):
            logits = target(prefixes[:, t : t + 1], cache=cache).logits[:, -1]
        return logits.double()


def _plain_law(target, params: SamplingParams, order: str = "tkp") -> torch.Tensor:
    """Exact law of the first NUM_TOKENS sampled tokens, dense [V^NUM_TOKENS] (index Σ t_i V^(n-1-i))."""
    vocab = target.config.vocab_size
    law = _warped(_next_logits(target, PROMPT[:, :0]), params, order)[0]  # [V]: prefixes of length 1
    for length in range(1, NUM_TOKENS):
        support = law.nonzero().squeeze(-1)  # codes of the prefixes with mass
        prefixes = torch.stack([support // vocab ** (length - 1 - i) % vocab for i in range(length)], dim=1)
        conditional = _warped(_next_logits(target, prefixes), params, order)  # [S, V]
        grown = torch.zeros(law.numel() * vocab, dtype=torch.float64)
        grown.view(-1, vocab)[support] = law[support, None] * conditional
        law = grown
    return law


def _first_verified_laws(table) -> dict[str, torch.Tensor]:
    """Law of (t1, t2) — t2 is the first verified token — under the correct rule and the wrong ones, dense [V²]."""
    p1 = _warped(table[0], SAMPLING)[0]  # [V]
    logits = table[1]  # [V, V]: row x = after t1 = x
    p2 = _warped(logits, SAMPLING)  # [V, V]
    q2 = (logits / DRAFT_SAMPLING.temperature).softmax(dim=-1)  # the drafter's law of d1 given t1
    accepted = torch.minimum(p2, q2)  # q · min(1, p/q)
    residual = (p2 - q2).clamp(min=0)
    residual_law = residual / residual.sum(-1, keepdim=True)
    accepted_q_over_p = q2 * torch.where(p2 > 0, torch.minimum(torch.ones_like(p2), q2 / p2.clamp(min=1e-300)), 1.0)
    conditionals = {
        "correct": accepted + residual,
        "resample_from_p": accepted + (1 - accepted.sum(-1, keepdim=True)) * p2,
        "always_accept": q2,
        "accept_min_1_q_over_p": accepted_q_over_p + (1 - accepted_q_over_p.sum(-1, keepdim=True)) * residual_law,
    }
    laws = {name: (p1[:, None] * conditional).flatten() for name, conditional in conditionals.items()}
    torch.testing.assert_close(laws["correct"], (p1[:, None] * p2).flatten())  # accepted + residual = p
    return laws


def _bonus_from_wrong_position_law(table) -> torch.Tensor:
    """k = 1: law of (t1, t2, t3) when the bonus after an accepted d1 = t2 is drawn from p(· | t1) (the
    draft position's law) instead of p(· | t1, t2); a rejected d1 leaves t3 to the next, correct step."""
    vocab = table[0].shape[-1]
    p1 = _warped(table[0], SAMPLING)[0]
    logits = table[1]
    p2 = _warped(logits, SAMPLING)  # [V, V]
    q2 = (logits / DRAFT_SAMPLING.temperature).softmax(dim=-1)
    accepted = torch.minimum(p2, q2)
    residual = (p2 - q2).clamp(min=0)
    p3 = _warped(table[2], SAMPLING).view(vocab, vocab, vocab)  # [x, y, z]
    law = p1[:, None, None] * (accepted[:, :, None] * p2[:, None, :] + residual[:, :, None] * p3)
    return law.flatten()


def _codes(sequences: torch.Tensor, vocab: int, num_tokens: int) -> torch.Tensor:
    new = sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + num_tokens]
    powers = vocab ** torch.arange(num_tokens - 1, -1, -1)
    return (new * powers).sum(dim=1)


@pytest.fixture(scope="module")
def table(target):
    return _logits_table(target)


@pytest.fixture(scope="module")
def exact(target, table):
    return {
        "plain": _plain_law(target, SAMPLING),
        "top_p_before_top_k": _plain_law(target, SAMPLING, order="tpk"),
        "temperature_after_top_p": _plain_law(target, SAMPLING, order="kpt"),
        "first_verified": _first_verified_laws(table),
        "bonus_from_wrong_position": _bonus_from_wrong_position_law(table),
    }


def _filter_order_laws(target, exact) -> dict[str, torch.Tensor]:
    """Wrong filter orders: a property of the sampler, not of the family, so checked on glm4_moe only (on
    other tiny targets some order may happen to give nearly the same law)."""
    if target.config.model_type != "glm4_moe":
        return {}
    return {name: exact[name] for name in ("top_p_before_top_k", "temperature_after_top_p")}


@pytest.mark.parametrize("target", ["glm4_moe"], indirect=True)  # plain_generate is family-independent
def test_plain_sampling_follows_the_filtered_law(target, exact):
    sequences = plain_generate(
        target, PROMPT.expand(NUM_ROWS, -1), max_new_tokens=NUM_TOKENS, sampling=SAMPLING,
        seed=list(range(NUM_ROWS)), eos_token_id=-1,
    )
    assert_law(_codes(sequences, target.config.vocab_size, NUM_TOKENS), exact["plain"],
               _filter_order_laws(target, exact))


# the k = 1 bonus-position rule is family-independent: other families run k = 2 (accept, recover, bonus)
@pytest.mark.parametrize(("target", "num_draft_tokens"), [("glm4_moe", 1), *((family, 2) for family in FAMILIES)],
                         indirect=["target"])
def test_speculative_sampling_with_a_bad_drafter_follows_the_target_law(target, exact, table, num_draft_tokens):
    vocab = target.config.vocab_size
    sequences, num_accepted, num_drafted = [], 0, 0
    for first in range(0, NUM_ROWS, BATCH_ROWS):
        out = speculative_generate(
            target, SharpDraft(target) if target.config.model_type == "glm4_moe" else TableDraft(table),
            PROMPT.expand(BATCH_ROWS, -1), max_new_tokens=NUM_TOKENS,
            num_draft_tokens=num_draft_tokens, sampling=SAMPLING, seed=list(range(first, first + BATCH_ROWS)),
            eos_token_id=-1,
        )
        sequences.append(out.sequences)
        num_accepted += out.stats.num_accepted
        num_drafted += out.stats.num_drafted
    sequences = torch.cat(sequences)
    acceptance = num_accepted / num_drafted
    assert 0.5 < acceptance < 0.98, f"the drafter should be accepted often but not always, got {acceptance:.3f}"
    first_verified = dict(exact["first_verified"])
    correct = first_verified.pop("correct")
    for name, law in _filter_order_laws(target, exact).items():  # their (t1, t2) margins
        first_verified[name] = law.view(vocab, vocab, vocab).sum(-1).flatten()
    assert_law(_codes(sequences, vocab, 2), correct, first_verified)
    wrong3 = _filter_order_laws(target, exact)
    if num_draft_tokens == 1:  # t3 is the bonus whenever d1 is accepted
        wrong3["bonus_from_wrong_position"] = exact["bonus_from_wrong_position"]
    assert_law(_codes(sequences, vocab, NUM_TOKENS), exact["plain"], wrong3)
