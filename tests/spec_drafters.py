"""Test drafters that share no cache or rollback code with the target: each draft step re-reads every row's
whole history through the target with transformers' plain forward (left-padded), so whatever the target's
cache does, the drafts depend only on the tokens. And the left-padded ragged prompt batch the speculative
tests decode."""

from __future__ import annotations

import torch

from omnimtp.sampling import SamplingParams
from omnimtp.spec_decode.proposer import _draw


def ragged_batch(seed: int, lengths=(7, 5, 3), pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of `lengths` (ids 3..63) and their attention mask, [B, max(lengths)] each."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 64, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


class RecomputingDraft:
    """Drafts from the target itself, recomputed from the token history (a Proposer).

    sampling: the drafter's own sampling (default: the run's); corrupt_rate: the share of drafts replaced
    by a random token (drawn from `seed`), so rows accept different numbers of drafts each step."""

    def __init__(self, target, sampling: SamplingParams | None = None, corrupt_rate: float = 0.0, seed: int = 0):
        self.target = target
        self.sampling = sampling
        self.corrupt_rate = corrupt_rate
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.history: list[list[int]] | None = None
        self.noise = torch.Generator().manual_seed(self.seed)

    def _next_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        width = max(len(seq) for seq in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        return self.target(ids, attention_mask=mask).logits[:, -1].float()  # [B, V]

    @torch.no_grad()
    def propose(self, block, num_draft_tokens, sampling, generators):
        batch_size, width = block.input_ids.shape
        if self.history is None:
            self.history = [[] for _ in range(batch_size)]
        block_mask = block.kv_mask[:, -width:]  # [B, W]
        sequences = []
        for row in range(batch_size):
            self.history[row] += block.input_ids[row][block_mask[row] == 1].tolist()
            sequences.append(self.history[row] + [int(block.next_ids[row, block.last_index[row]])])
        draft_sampling = self.sampling or sampling
        if self.corrupt_rate and not draft_sampling.is_greedy:
            raise ValueError("corrupt_rate: corrupted drafts are not drawn from the reported probs; greedy only")
        draft_tokens, draft_probs = [], []
        for _ in range(num_draft_tokens):
            token, probs = _draw(self._next_logits(sequences), draft_sampling, generators)
            if self.corrupt_rate:
                corrupt = torch.rand(batch_size, generator=self.noise) < self.corrupt_rate
                random_tokens = torch.randint(0, probs.shape[-1], (batch_size,), generator=self.noise)
                token = torch.where(corrupt, random_tokens, token)
                probs = torch.where(
                    corrupt[:, None], torch.nn.functional.one_hot(token, probs.shape[-1]).float(), probs
                )
            draft_tokens.append(token)
            draft_probs.append(probs)
            sequences = [seq + [int(t)] for seq, t in zip(sequences, token, strict=True)]
        return torch.stack(draft_tokens, dim=1), torch.stack(draft_probs, dim=1)


class RowDroppingRecomputingDraft(RecomputingDraft):
    """A `RecomputingDraft` with `keep_rows`: a batch drafted by it drops its finished rows. A block whose rows
    are not the rows it keeps a history for is an error (a loop that dropped rows without telling it)."""

    def keep_rows(self, rows: list[int]) -> None:
        if self.history is not None:
            self.history = [self.history[i] for i in rows]

    def propose(self, block, num_draft_tokens, sampling, generators):
        if self.history is not None and len(self.history) != block.input_ids.shape[0]:
            raise AssertionError(f"a block of {block.input_ids.shape[0]} rows, a history of {len(self.history)}")
        return super().propose(block, num_draft_tokens, sampling, generators)
