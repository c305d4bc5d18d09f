"""Drafters: given what the target just verified, propose the next k tokens and their distributions.

Slot layout (shared with `speculative_generate`): every KV cache — target's and drafter's — holds one slot
per token the target has processed, in the order it processed them; `kv_mask [B, L]` says which slots are
real for each row (left padding of ragged prompts, and the rejected tail of a verify block when other rows
of the batch accepted more). A drafter keeps its cache aligned with the target's: on entry it holds the
slots before the new block, it appends the block, drafts, and crops its speculative slots again. A drafter
with `keep_rows` lets a batch drop its finished rows: the loop then keeps only the rows still generating, in
the drafter as in the target; a drafter without it sees every row until the batch ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from omnimtp.mtp.head import MTPHead
from omnimtp.runtime.kv_cache import keep_cache_rows
from omnimtp.sampling import SamplingParams, exponential_noise, probs_from_logits, sample_from_probs


@dataclass
class DraftInput:
    """What the target just processed: a block of W slots appended to its cache.

    input_ids [B, W]: the tokens the target read (prompt, or [pending token, drafts...]);
    next_ids [B, W]: the token that follows each slot (x_{t+1}); garbage on invalid slots;
    hidden [B, W, H]: the target's post-norm last hidden row of each slot;
    position_ids [B, W]: position of input_ids;
    kv_mask [B, L + W]: validity of every slot so far, the block included;
    last_index [B]: slot (in the block) of each row's last real token; its next id is the newest token;
    next_position_ids [3, B, W] or None: the positions of next_ids where they are not position_ids + 1 (the
    M-RoPE ids of an omni prompt with images or video)."""

    input_ids: torch.Tensor
    next_ids: torch.Tensor
    hidden: torch.Tensor
    position_ids: torch.Tensor
    kv_mask: torch.Tensor
    last_index: torch.Tensor
    next_position_ids: torch.Tensor | None = None


def select_rows(block: DraftInput, index: torch.Tensor) -> DraftInput:
    """The rows `index` [R] of `block`, in that order (a batch whose finished rows leave)."""
    return DraftInput(
        input_ids=block.input_ids[index], next_ids=block.next_ids[index], hidden=block.hidden[index],
        position_ids=block.position_ids[index], kv_mask=block.kv_mask[index], last_index=block.last_index[index],
        next_position_ids=None if block.next_position_ids is None else block.next_position_ids[:, index],
    )


def extend_block(block: DraftInput, new: DraftInput) -> DraftInput:
    """The slots of `block` followed by those of `new` (appended after it) as one block: what a drafter
    reads after steps that drafted nothing (plain steps of an adaptive run)."""
    next_positions = None
    if block.next_position_ids is not None or new.next_position_ids is not None:
        next_positions = torch.cat([
            (b.position_ids + 1).expand(3, -1, -1) if b.next_position_ids is None else b.next_position_ids
            for b in (block, new)
        ], dim=2)  # [3, B, W + W']
    return DraftInput(
        input_ids=torch.cat([block.input_ids, new.input_ids], dim=1),
        next_ids=torch.cat([block.next_ids, new.next_ids], dim=1),
        hidden=torch.cat([block.hidden, new.hidden], dim=1),
        position_ids=torch.cat([block.position_ids, new.position_ids], dim=1),
        kv_mask=new.kv_mask,
        last_index=block.input_ids.shape[1] + new.last_index,
        next_position_ids=next_positions,
    )


def with_plain_steps(
    block: DraftInput, steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], next_position: torch.Tensor,
    kv_mask: torch.Tensor,
) -> DraftInput:
    """`block` followed by the slots of n plain one-token steps after it (an adaptive run's k = 0 steps,
    which a drafter reads with the next step that drafts): steps[j] = (the token read [B], the token
    sampled after it [B], the read token's hidden [B, H]), step j at position next_position [B] + j;
    kv_mask [B, L + W + n] the validity of every slot, the new ones included."""
    read_ids, next_ids, hidden = (
        torch.stack(parts, dim=1) for parts in zip(*steps, strict=True)
    )  # [B, n], [B, n], [B, n, H]
    batch_size, num_steps = read_ids.shape
    plain = DraftInput(
        input_ids=read_ids, next_ids=next_ids, hidden=hidden,
        position_ids=next_position[:, None] + torch.arange(num_steps, device=read_ids.device),
        kv_mask=kv_mask, last_index=torch.full((batch_size,), num_steps - 1, device=read_ids.device),
    )
    return extend_block(block, plain)


def check_drafts(draft_tokens, batch_size: int, num_draft_tokens: int, vocab_size: int) -> None:
    """ValueError unless a Proposer's draft_tokens are [B, k] integer ids in [0, vocab_size)."""
    if not isinstance(draft_tokens, torch.Tensor) or tuple(draft_tokens.shape) != (batch_size, num_draft_tokens):
        raise ValueError(f"proposer: draft_tokens must be a [B, k] = {(batch_size, num_draft_tokens)} tensor, "
                         f"got {getattr(draft_tokens, 'shape', draft_tokens)!r}")
    if draft_tokens.dtype not in (torch.int64, torch.int32) or bool(
        ((draft_tokens < 0) | (draft_tokens >= vocab_size)).any()
    ):
        raise ValueError(f"proposer: draft_tokens must be integer ids in [0, {vocab_size})")


class Proposer(Protocol):
    def reset(self) -> None:
        """Forget any state (call before a new batch of prompts)."""

    # Optional: def keep_rows(self, rows: list[int]) -> None — keep only the batch rows `rows` (in that
    # order) of any per-row state, as the target's cache does; the next block has len(rows) rows.

    def propose(
        self,
        block: DraftInput,
        num_draft_tokens: int,
        sampling: SamplingParams | list[SamplingParams],
        generators: list[torch.Generator] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ draft_tokens [B, k] long, draft_probs [B, k, V] (one-hot for greedy sampling). sampling: the
        run's, or one per row (drawn by `_draw`)."""


def _draw(
    logits: torch.Tensor, sampling: SamplingParams | list[SamplingParams], generators
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] → (token [B], probs [B, V]) filtered exactly as the target's are. sampling: one for
    every row, or a list with one per row (the omni thinker's cohorts mix requests); a greedy row of such
    a list draws no noise, a sampled row draws from its own generator only."""
    if isinstance(sampling, list):
        drawn = [
            _draw(logits[b : b + 1], params, None if generators is None else [generators[b]])
            for b, params in enumerate(sampling)
        ]
        return torch.cat([token for token, _ in drawn]), torch.cat([probs for _, probs in drawn])
    probs = probs_from_logits(logits, sampling)  # [B, V]
    if sampling.is_greedy:
        return logits.argmax(dim=-1), probs
    noise = exponential_noise(tuple(probs.shape), generators, device=probs.device)
    return sample_from_probs(probs, noise), probs


def _crop_to(cache: DynamicCache, length: int, layer_idx: int = 0) -> None:
    excess = cache.get_seq_length(layer_idx) - length
    if excess > 0:
        cache.crop(-excess)


class MTPProposer:
    """Drafts with one MTP head applied k times; its output hidden feeds the next step.

    Step 1 reads the pairs (next_ids, hidden) of the whole new block at positions + 1 and drafts from each
    row's last real slot; steps 2..k read (previous draft, previous head hidden) one slot at a time.
    Heads with a packed `draft_step` (glm4_moe) run it on a `KVCache` (made for the first block's batch
    size); others run the head's transformers forward on a `DynamicCache`. A GLM-5 head with IndexShare
    runs its indexer in step 1 only; steps 2..k reuse that step's key selection at the drafting row.
    The packed weights are taken when the proposer is made and on `reset` (checking them costs about as
    much as a draft step's norms): weights edited during a run are seen from the next run."""

    def __init__(self, head: MTPHead):
        self.head = head
        self.reset()

    def reset(self) -> None:
        self.packed = self.head.packed() if self.head.supports_draft_step else None
        self.cache = None if self.packed is not None else self.head.make_cache()

    def keep_rows(self, rows: list[int]) -> None:
        if self.cache is not None:
            keep_cache_rows(self.cache, rows)

    def _step(self, input_ids, prev_hidden, position_ids, kv_mask, last_index=None, packed=None, shared_selection=None):
        """One head pass appended to the cache → (hidden [B, 1, H], logits [B, V], the DSA key selection
        [B, S] or None), each of the slot at last_index or the last slot. packed: the head's packed weights
        (heads with `draft_step`); shared_selection [B, 1, S']: IndexShare's reused selection (DSA heads)."""
        head = self.head
        if packed is not None:
            return (
                *head.draft_step(input_ids, prev_hidden, position_ids, self.cache, kv_mask, last_index, packed), None
            )
        out = head(
            input_ids, prev_hidden, position_ids=position_ids, attention_mask=kv_mask, cache=self.cache,
            compute_logits=False, shared_selection=shared_selection,
        )
        rows = torch.arange(out.hidden.shape[0])
        index = torch.full_like(rows, out.hidden.shape[1] - 1) if last_index is None else last_index
        selection = None if out.selection is None else out.selection[rows, index]
        hidden = out.hidden[rows, index]  # [B, H]
        return hidden[:, None], head.logits(hidden), selection

    @torch.no_grad()
    def propose(self, block, num_draft_tokens, sampling, generators):
        head, layer_idx = self.head, self.head.layer_idx
        batch_size, width = block.next_ids.shape
        rows = torch.arange(batch_size, device=block.next_ids.device)
        num_aligned = block.kv_mask.shape[1]
        if self.cache is None:
            self.cache = head.make_draft_cache(batch_size, capacity=num_aligned + num_draft_tokens)
        if self.cache.get_seq_length(layer_idx) != num_aligned - width:
            raise ValueError("block: the drafter's cache is not aligned with the target's (call reset() first?)")

        # No invalid slot anywhere (batch 1 without padding): no mask, so attention can skip it for one token.
        kv_mask = None if bool(block.kv_mask.all()) else block.kv_mask
        packed = self.packed
        next_positions = block.position_ids + 1 if block.next_position_ids is None else block.next_position_ids
        hidden, logits, selection = self._step(
            block.next_ids, block.hidden, next_positions, kv_mask, block.last_index, packed
        )
        # IndexShare: steps 2..k attend to step 1's selection (+ the chain's own keys)
        shared_selection = selection[:, None] if head.index_share else None  # [B, 1, S]
        position = block.position_ids[rows, block.last_index] + 1  # [B] position of the newest token
        is_greedy = not isinstance(sampling, list) and sampling.is_greedy
        draft_tokens, draft_probs = [], []
        for step in range(num_draft_tokens):
            if is_greedy:  # the one-hot distributions are made once, below
                token = logits.argmax(dim=-1)
            else:
                token, probs = _draw(logits, sampling, generators)
                draft_probs.append(probs)
            draft_tokens.append(token)
            if step == num_draft_tokens - 1:
                break
            if kv_mask is not None:
                kv_mask = torch.cat([kv_mask, kv_mask.new_ones(batch_size, 1)], dim=1)
            hidden, logits, _ = self._step(
                token[:, None], hidden, (position + step + 1)[:, None], kv_mask, None, packed, shared_selection
            )
        _crop_to(self.cache, num_aligned, layer_idx)
        tokens = torch.stack(draft_tokens, dim=1)  # [B, k]
        if is_greedy:  # one-hot rows (scatter: `one_hot` would first check every id's range)
            return tokens, logits.new_zeros(*tokens.shape, logits.shape[-1]).scatter_(2, tokens[..., None], 1.0)
        return tokens, torch.stack(draft_probs, dim=1)


class ArgmaxDrafts:
    """Another proposer's drafts taken by argmax whatever the sampling (q one-hot, as vLLM drafts): a sampled
    run's verification then accepts draft x with probability p(x) and resamples from p without x, still
    lossless but accepting less than drafts sampled from q and verified with min(1, p/q). Greedy runs are
    unchanged. The inner proposer draws no random numbers."""

    def __init__(self, proposer):
        self.proposer = proposer

    def reset(self) -> None:
        self.proposer.reset()

    def __getattr__(self, name):  # keep_rows exactly where the inner proposer has it
        if name == "keep_rows":
            return self.proposer.keep_rows
        raise AttributeError(name)

    def propose(self, block, num_draft_tokens, sampling, generators):
        return self.proposer.propose(block, num_draft_tokens, SamplingParams.greedy(), None)


class TargetProposer:
    """The target drafting for itself (a drafter that always agrees with greedy verification).

    For tests and as a ceiling: with greedy sampling every draft is accepted, which exercises the
    all-accepted + bonus path; with sampling q = p up to float rounding."""

    def __init__(self, target):
        self.target = target
        self.cache = DynamicCache(config=target.config)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.target.config)

    def keep_rows(self, rows: list[int]) -> None:
        keep_cache_rows(self.cache, rows)

    def _logits(self, input_ids, position_ids, kv_mask) -> torch.Tensor:
        hidden = self.target.get_decoder()(
            input_ids=input_ids, attention_mask=kv_mask, position_ids=position_ids, cache=self.cache, use_cache=True
        ).last_hidden_state
        return self.target.get_output_embeddings()(hidden[:, -1])  # [B, V]

    @torch.no_grad()
    def propose(self, block, num_draft_tokens, sampling, generators):
        batch_size, width = block.input_ids.shape
        rows = torch.arange(batch_size, device=block.input_ids.device)
        num_aligned = block.kv_mask.shape[1]
        if self.cache.get_seq_length() != num_aligned - width:
            raise ValueError("block: the drafter's cache is not aligned with the target's (call reset() first?)")
        self._logits(block.input_ids, block.position_ids, block.kv_mask)
        token = block.next_ids[rows, block.last_index]  # [B] the newest token, not yet read by the target
        position = block.position_ids[rows, block.last_index] + 1  # [B]
        kv_mask = block.kv_mask
        draft_tokens, draft_probs = [], []
        for step in range(num_draft_tokens):
            kv_mask = torch.cat([kv_mask, kv_mask.new_ones(batch_size, 1)], dim=1)
            logits = self._logits(token[:, None], (position + step)[:, None], kv_mask)
            token, probs = _draw(logits, sampling, generators)
            draft_tokens.append(token)
            draft_probs.append(probs)
        _crop_to(self.cache, num_aligned)
        return torch.stack(draft_tokens, dim=1), torch.stack(draft_probs, dim=1)
