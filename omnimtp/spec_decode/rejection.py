"""Verification of a chain of k drafted tokens against the target's distributions (lossless).

Sampled rows (speculative sampling, Leviathan et al. / Chen et al.): draft i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection a *recovered* token is drawn from
normalize(max(p_i − q_i, 0)) and the chain stops; when all k drafts are accepted a *bonus* token is drawn
from p_{k+1}. Every emitted token then has exactly the target's distribution.

Greedy rows: accept while draft == argmax p_i, then emit argmax p at the first mismatch (or the bonus argmax).

Worked example, k = 3, one row: drafts [7, 4, 9]; 7 and 4 accepted, 9 rejected → tokens [7, 4, r, -1],
num_emitted 3, where r is the recovered token at position 2.

Randomness: each sampled row draws k uniforms (float64: a float32 uniform can be exactly 0 and accept a
token with p = 0) and then V Exp(1) variables for the final token's Gumbel-max race — always the same
amount, whatever is accepted, so a row's stream of random numbers is fixed by its generator alone.
"""

from __future__ import annotations

import torch

PROBS_SUM_ATOL = 1e-3


def _check_probs(name: str, probs: torch.Tensor) -> None:
    if not torch.is_floating_point(probs):
        raise ValueError(f"{name} must be a floating point tensor, got {probs.dtype}")
    if (probs < 0).any():
        raise ValueError(f"{name} has negative entries")
    sums = probs.sum(dim=-1, dtype=torch.float64)
    if not torch.allclose(sums, torch.ones_like(sums), atol=PROBS_SUM_ATOL, rtol=0.0):
        worst = (sums - 1).abs().max().item()
        raise ValueError(f"{name} must sum to 1 over the vocab (off by up to {worst:.3g})")


def _random_draws(
    batch_size: int, num_draft: int, vocab_size: int, generators: list[torch.Generator] | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """uniforms [B, k] float64 and Exp(1) noise [B, V] float32; row b from generators[b] (or the global RNG)."""
    if generators is None:
        uniforms = torch.rand(batch_size, num_draft, dtype=torch.float64, device=device)
        noise = torch.empty(batch_size, vocab_size, device=device).exponential_()
        return uniforms, noise
    if len(generators) != batch_size:
        raise ValueError(f"generators must have one entry per row: got {len(generators)} for {batch_size} rows")
    uniform_rows, noise_rows = [], []
    for g in generators:
        uniform_rows.append(torch.rand(num_draft, dtype=torch.float64, device=device, generator=g))
        noise_rows.append(torch.empty(vocab_size, device=device).exponential_(generator=g))
    return torch.stack(uniform_rows), torch.stack(noise_rows)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool | torch.Tensor,
    generators: list[torch.Generator] | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts; pure function of its inputs and the generators.

    target_probs [B, k+1, V]: the target's (filtered) distribution after each prefix, including the bonus one.
    draft_tokens [B, k] long. draft_probs [B, k, V]: the distributions the drafts were drawn from (needed
    unless every row is greedy). greedy: bool or BoolTensor [B]. generators: one per row, or None for the
    global RNG. check_values=False skips the checks that read the tensors' values (draft ids in range,
    distributions non-negative and summing to 1; shapes and dtypes are always checked): for the decoding
    loops, whose drafts and distributions come from `probs_from_logits` of the same step.

    Returns tokens [B, k+1] (accepted drafts, then the recovered/bonus token, then −1 padding) and
    num_emitted [B] in 1..k+1."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, k+1, V], got shape {tuple(target_probs.shape)}")
    batch_size, num_positions, vocab_size = target_probs.shape
    num_draft = num_positions - 1
    if num_draft < 1:
        raise ValueError(f"target_probs must have k+1 >= 2 positions, got {num_positions}")
    if draft_tokens.shape != (batch_size, num_draft):
        raise ValueError(f"draft_tokens must be [B, k] = {(batch_size, num_draft)}, got {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if check_values and ((draft_tokens < 0) | (draft_tokens >= vocab_size)).any():
        raise ValueError(f"draft_tokens must be in [0, {vocab_size})")
    if isinstance(greedy, bool):
        greedy_rows = torch.full((batch_size,), greedy, dtype=torch.bool, device=target_probs.device)
    elif isinstance(greedy, torch.Tensor) and greedy.dtype == torch.bool and greedy.shape == (batch_size,):
        greedy_rows = greedy.to(target_probs.device)
    else:
        raise ValueError(f"greedy must be a bool or a BoolTensor of shape [{batch_size}], got {greedy!r}")
    if check_values:
        _check_probs("target_probs", target_probs)
    any_sampled = bool((~greedy_rows).any())
    if any_sampled:
        if draft_probs is None:
            raise ValueError("draft_probs is required when any row samples (greedy is False)")
        if draft_probs.shape != (batch_size, num_draft, vocab_size):
            raise ValueError(
                f"draft_probs must be [B, k, V] = {(batch_size, num_draft, vocab_size)}, got {tuple(draft_probs.shape)}"
            )
        if check_values:
            _check_probs("draft_probs", draft_probs[~greedy_rows])
    draft_tokens = draft_tokens.long()
    rows = torch.arange(batch_size, device=target_probs.device)

    # Which drafts are accepted, position by position.
    target_argmax = target_probs.argmax(dim=-1)  # [B, k+1]
    accept = draft_tokens == target_argmax[:, :num_draft]  # [B, k] greedy rule
    if any_sampled:
        uniforms, noise = _random_draws(batch_size, num_draft, vocab_size, generators, target_probs.device)
        p_draft = target_probs[:, :num_draft].gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [B, k]
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()  # [B, k]
        accept_sampled = uniforms * q_draft < p_draft  # u < p/q without dividing by q
        accept = torch.where(greedy_rows[:, None], accept, accept_sampled)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] drafts before the first rejection

    # The token after the accepted prefix: recovered (from the residual) or bonus (from p_{k+1}).
    final_tokens = target_argmax[rows, num_accepted]  # [B] greedy rule
    if any_sampled:
        p_final = target_probs[rows, num_accepted].float()  # [B, V]
        padded_q = torch.cat([draft_probs.float(), torch.zeros_like(p_final)[:, None]], dim=1)  # [B, k+1, V]
        q_final = padded_q[rows, num_accepted]  # [B, V] zeros for the bonus position
        residual = (p_final - q_final).clamp(min=0.0)  # [B, V]
        # p == q leaves no residual; then rejection had probability 0, so fall back to p
        # (never reached in exact arithmetic)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_final, residual)
        sampled_final = (residual / noise).argmax(dim=-1)  # Gumbel-max draw ∝ residual
        final_tokens = torch.where(greedy_rows, final_tokens, sampled_final)

    positions = torch.arange(num_positions, device=target_probs.device)
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((batch_size, 1), -1)], dim=1)  # [B, k+1]
    tokens = torch.where(positions[None] < num_accepted[:, None], padded_drafts, -1)  # [B, k+1]
    tokens[rows, num_accepted] = final_tokens
    return tokens, num_accepted + 1
