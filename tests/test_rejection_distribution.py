"""rejection_sample's output law, exactly: on hand-built p, q the law of the whole emitted sequence is
enumerated, many seeded draws are compared with it in total variation, and the bound is shown (in the test)
to be far below the distance of every plausible wrong rule — so each of those rules fails the test."""

from __future__ import annotations

import itertools
import math

import torch
from distribution_checks import assert_law

from omnimtp.spec_decode.rejection import rejection_sample

# ---------------------------------------------------------------------------------------------------------
# The exact law of one verification: k context-free positions.

VOCAB = 4
# p_i: the target after i accepted drafts (i = 0..k, the last one for the bonus); q_i: the drafter.
P = torch.tensor([
    [0.50, 0.30, 0.20, 0.00],
    [0.10, 0.10, 0.40, 0.40],
    [0.70, 0.10, 0.10, 0.10],
], dtype=torch.float64)
Q = torch.tensor([
    [0.10, 0.20, 0.30, 0.40],  # mass where p is 0: those drafts must always be rejected
    [0.40, 0.40, 0.10, 0.10],
], dtype=torch.float64)
NUM_DRAFT = Q.shape[0]


def _accept_probability(rule: str, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(accept | draft x) per x under each verification rule."""
    if rule == "always_accept":
        return torch.ones_like(p)
    if rule == "accept_min_1_q_over_p":
        return torch.where(p > 0, torch.minimum(torch.ones_like(p), q / p.clamp(min=1e-300)), 1.0)
    if rule == "accept_with_p":
        return p
    return torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp(min=1e-300)), 0.0)


def emitted_law(rule: str = "correct", p: torch.Tensor = P, q: torch.Tensor = Q) -> torch.Tensor:
    """Law of the emitted tokens [t_0, ..., t_{n-1}, -1...] of `rejection_sample` (k = len(q)) under `rule`,
    as a dense tensor over the codes of `sequence_code`.

    A sequence of n tokens means n − 1 accepted drafts, then a recovered token (n <= k) or the bonus
    (n = k + 1); P = Π_{j<n-1} q_j(x_j) a_j(x_j) · (recovered or bonus law). The correct rule accepts with
    min(1, p/q) and recovers from max(p − q, 0) ∝ what rejection leaves, which makes t_j ~ p_j."""
    num_draft = q.shape[0]
    law = torch.zeros((VOCAB + 1) ** (num_draft + 1), dtype=torch.float64)
    for num_accepted in range(num_draft + 1):
        for prefix in itertools.product(range(VOCAB), repeat=num_accepted):
            weight = 1.0
            for j, x in enumerate(prefix):
                weight *= (q[j, x] * _accept_probability(rule, p[j], q[j])[x]).item()
            if num_accepted == num_draft:
                if rule == "bonus_not_emitted":
                    law[sequence_code(prefix)] += weight
                    continue
                bonus_position = num_draft - 1 if rule == "bonus_from_last_draft_position" else num_draft
                final = p[bonus_position]
            else:
                j = num_accepted
                rejected = 1 - (q[j] * _accept_probability(rule, p[j], q[j])).sum()
                residual = (p[j] - q[j]).clamp(min=0)
                final = rejected * (p[j] if rule == "resample_from_p" else residual / residual.sum())
            for token in range(VOCAB):
                law[sequence_code(prefix + (token,))] += weight * final[token].item()
    return law


def sequence_code(tokens) -> int:
    """An emitted sequence (a tuple, or a −1-padded row) → one integer: Σ_j (t_j + 1)·(V + 1)^j."""
    return sum((int(t) + 1) * (VOCAB + 1) ** j for j, t in enumerate(tokens))


def _codes(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [N, k+1] (−1 padded) → sequence codes [N]."""
    powers = (VOCAB + 1) ** torch.arange(tokens.shape[1])
    return ((tokens + 1) * powers).sum(dim=1)


WRONG_RULES = (
    "resample_from_p", "always_accept", "accept_min_1_q_over_p", "accept_with_p",
    "bonus_not_emitted", "bonus_from_last_draft_position",
)


def test_the_correct_law_emits_p_at_every_position():
    """Sanity of the enumeration itself: under the correct rule the token at position j, when reached, is
    distributed as p_j, and draft j is accepted with probability Σ min(p_j, q_j)."""
    law = emitted_law()
    for position in range(NUM_DRAFT + 1):
        marginal = torch.zeros(VOCAB, dtype=torch.float64)
        reached = 0.0
        for code in law.nonzero().squeeze(-1).tolist():
            digits = [(code // (VOCAB + 1) ** j) % (VOCAB + 1) - 1 for j in range(NUM_DRAFT + 1)]
            if digits[position] >= 0:
                marginal[digits[position]] += law[code]
                reached += law[code].item()
        torch.testing.assert_close(marginal / reached, P[position])
    accepted_first = sum(law[c].item() for c in law.nonzero().squeeze(-1).tolist() if (c // (VOCAB + 1)) % (VOCAB + 1))
    assert math.isclose(accepted_first, torch.minimum(P[0], Q[0]).sum().item())


def _draw(num_rows: int, seed: int, per_row_generators: bool) -> torch.Tensor:
    """Drafts from Q, verified against P: emitted tokens [N, k+1] (−1 padded). Without per-row generators
    rejection_sample draws from the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.stack(
        [torch.multinomial(Q[j], num_rows, replacement=True, generator=generator) for j in range(NUM_DRAFT)], dim=1
    )  # [N, k]
    generators = [torch.Generator().manual_seed(seed + row) for row in range(num_rows)] if per_row_generators else None
    tokens, num_emitted = rejection_sample(
        P.float().expand(num_rows, -1, -1), drafts, Q.float().expand(num_rows, -1, -1), greedy=False,
        generators=generators,
    )
    assert torch.equal((tokens >= 0).sum(1), num_emitted)
    return tokens


def test_emitted_sequences_follow_the_exact_law_and_no_wrong_rule_would():
    tokens = _draw(200_000, seed=20, per_row_generators=False)
    assert_law(_codes(tokens), emitted_law(), {rule: emitted_law(rule) for rule in WRONG_RULES})


def test_per_row_generators_give_the_same_law():
    """The seeded path (one generator per row, the one speculative_generate uses) draws from the same law."""
    tokens = _draw(50_000, seed=30, per_row_generators=True)
    assert_law(_codes(tokens), emitted_law(), {rule: emitted_law(rule) for rule in WRONG_RULES})
