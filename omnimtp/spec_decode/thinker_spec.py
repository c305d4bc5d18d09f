"""Speculative steps of the omni thinker: what `omnimtp.thinker.ThinkerRun(speculation=...)` drafts with,
how it verifies, and the proposer's view of the run.

One speculative step of a run, request i, k = 3:

    proposer  → d1 d2 d3                                  (MTP head applied 3×, or any `Proposer`)
    thinker   ← [last, d1, d2, d3] appended to slot i      → logits after each of the 4 rows (one forward)
    verify    → e.g. d1 accepted, d2 rejected → emit d1, r; the events carry (row(last), d1), (row(d1), r)
    rollback  : slot i keeps last and d1 (its length is reset: the KV cache is written by index); r pends

The thinker's cache has one ragged slot per request (`omnimtp.runtime.kv_cache.KVCache`). Proposers speak
`speculative_generate`'s layout instead (`DraftInput`: every row shares one length, a kv_mask marks the
holes). `DraftLayout` keeps that view for the run's B rows: the prefill block is the prompts left-padded,
each verify block adds max_b kept_b slots, and a finished request's row leaves it (`keep_rows`, with the
proposer's own rows) where the proposer can drop rows; else it rides along with one slot.
Positions are the thinker's RoPE positions (slot index + the slot's M-RoPE offset, equal on all axes after
the prefill), so an MTP head drafts at the positions the thinker decodes at.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from omnimtp.mtp.head import MTPHead
from omnimtp.sampling import SamplingParams, probs_from_logits
from omnimtp.spec_decode.adaptive import (
    AUTO,
    DraftController,
    DraftCosts,
    DraftCostTable,
    FixedDrafts,
    check_num_draft_tokens,
)
from omnimtp.spec_decode.generate import greedy_verify
from omnimtp.spec_decode.proposer import DraftInput, MTPProposer, Proposer, select_rows, with_plain_steps
from omnimtp.spec_decode.rejection import rejection_sample

GREEDY = SamplingParams.greedy()


@dataclass(frozen=True)
class ThinkerSpeculation:
    """Validated settings of the thinker's speculative steps.

    drafter: an `MTPHead` for the thinker, or any `Proposer` (each run drafts with its own `copy.copy`
    of it, `reset()` first, so runs that overlap never share drafter state). num_draft_tokens: k >= 1, or
    "auto" (`omnimtp.spec_decode.adaptive`: each step of a run drafts 0..K tokens, one k for the run's
    rows still running, with draft_costs — one `DraftCosts`, or a `DraftCostTable` per batch size — or, when
    None, costs measured once per thinker and batch-size bucket: at a server's start-up, else on first use)."""

    drafter: object
    num_draft_tokens: int | str
    draft_costs: DraftCosts | DraftCostTable | None = None

    def __post_init__(self):
        check_num_draft_tokens(self.num_draft_tokens)
        if self.draft_costs is not None and (
            self.num_draft_tokens != AUTO or not isinstance(self.draft_costs, (DraftCosts, DraftCostTable))
        ):
            raise ValueError("draft_costs: a DraftCosts or DraftCostTable, set only with num_draft_tokens='auto'")
        drafter = self.drafter
        if not isinstance(drafter, MTPHead) and not (
            callable(getattr(drafter, "propose", None)) and callable(getattr(drafter, "reset", None))
        ):
            raise ValueError(
                f"thinker_mtp must be an MTPHead, a Proposer or a head directory, got {type(drafter).__name__}"
            )

    def check(self, thinker) -> None:
        """ValueError when an MTP head does not fit the thinker (hidden size, vocab)."""
        if not isinstance(self.drafter, MTPHead):
            return
        config = thinker.config.get_text_config(decoder=True)
        if self.drafter.hidden_size != config.hidden_size:
            raise ValueError(
                f"thinker_mtp: hidden size {self.drafter.hidden_size} does not match the thinker's {config.hidden_size}"
            )
        vocab = thinker.get_output_embeddings().weight.shape[0]
        if self.drafter.vocab_size != vocab:
            raise ValueError(f"thinker_mtp: vocab size {self.drafter.vocab_size} does not match the thinker's {vocab}")

    @property
    def is_adaptive(self) -> bool:
        return self.num_draft_tokens == AUTO

    def new_controller(self, costs: DraftCostTable | None, num_rows: int) -> DraftController | FixedDrafts:
        """A run's controller: fixed k, or adaptive with `costs` (draft_costs when given)."""
        if not self.is_adaptive:
            return FixedDrafts(self.num_draft_tokens)
        return DraftController(self.draft_costs or costs, num_rows)

    def new_proposer(self) -> Proposer:
        if isinstance(self.drafter, MTPHead):
            return MTPProposer(self.drafter)
        proposer = copy.copy(self.drafter)
        proposer.reset()
        return proposer


def thinker_speculation(thinker, thinker_mtp, num_draft_tokens: int | str | None) -> ThinkerSpeculation | None:
    """What `OmniPipeline(thinker_mtp=..., num_draft_tokens=...)` and `--thinker-mtp DIR -k K` ask for:
    thinker_mtp None (no speculation; num_draft_tokens must be None too), a directory holding the thinker's
    MTP head (`model-mtp.safetensors`, see `omnimtp.mtp.head`), an `MTPHead` or any `Proposer`;
    num_draft_tokens k >= 1 or "auto", default 3. ValueError naming the argument otherwise."""
    if thinker_mtp is None:
        if num_draft_tokens is not None:
            raise ValueError(
                "num_draft_tokens: set only with thinker_mtp (the drafter of the thinker's speculative steps)"
            )
        return None
    if isinstance(thinker_mtp, (str, os.PathLike)):
        try:
            thinker_mtp = MTPHead.from_pretrained(thinker_mtp, thinker).eval()
        except ValueError as exc:
            raise ValueError(f"thinker_mtp: {exc}") from None
    speculation = ThinkerSpeculation(thinker_mtp, 3 if num_draft_tokens is None else num_draft_tokens)
    speculation.check(thinker)
    return speculation


class DraftLayout:
    """The proposer's shared-length view of a run's B rows (see the module docstring)."""

    def __init__(
        self, prompts: list[list[int]], first_ids: list[int], hidden: list[torch.Tensor], positions: list[torch.Tensor],
        rope_positions: list[torch.Tensor | None],
    ):
        """prompts[b] (P_b ids), first_ids[b] (the token the prefill sampled), hidden[b] [P_b, H] the
        prefill's rows after the final norm, positions[b] [P_b] their 1-D RoPE positions (cache index + the
        slot's offset), rope_positions[b] [3, P_b] the prefill's M-RoPE ids where it had images or video."""
        batch_size, width = len(prompts), max(len(p) for p in prompts)
        device, dtype = hidden[0].device, hidden[0].dtype
        input_ids = torch.zeros(batch_size, width, dtype=torch.long, device=device)
        next_ids = torch.zeros_like(input_ids)
        position_ids = torch.ones_like(input_ids)
        kv_mask = torch.zeros_like(input_ids)
        rows = torch.zeros(batch_size, width, hidden[0].shape[-1], dtype=dtype, device=device)
        for b, prompt in enumerate(prompts):
            pad = width - len(prompt)
            input_ids[b, pad:] = torch.tensor(prompt, device=device)
            next_ids[b, pad:] = torch.tensor(prompt[1:] + [first_ids[b]], device=device)
            position_ids[b, pad:] = positions[b]
            kv_mask[b, pad:] = 1
            rows[b, pad:] = hidden[b]
        next_position_ids = None  # the M-RoPE ids of x_{t+1}: the prompt's own, then the first token's (all axes)
        if any(r is not None for r in rope_positions):
            next_position_ids = (position_ids + 1).expand(3, -1, -1).clone()  # [3, B, W]
            for b, rope in enumerate(rope_positions):
                if rope is not None:
                    next_position_ids[:, b, width - len(prompts[b]) : -1] = rope[:, 1:]
        self._block = DraftInput(
            input_ids=input_ids, next_ids=next_ids, hidden=rows, position_ids=position_ids, kv_mask=kv_mask,
            last_index=torch.full((batch_size,), width - 1, device=device), next_position_ids=next_position_ids,
        )
        self._plain_steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # see `advance_plain`
        self.pending = torch.tensor(first_ids, device=device)  # [B] emitted, not yet read by the thinker
        self.next_positions = position_ids[:, -1] + 1  # [B] the pending token's position
        self.requests = list(range(batch_size))  # the request of each row (rows of finished ones leave)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only rows `rows` (positions in `requests`), in that order."""
        index = torch.tensor(rows, device=self.pending.device)
        self._block = select_rows(self._block, index)
        self._plain_steps = [tuple(part[index] for part in step) for step in self._plain_steps]
        self.pending, self.next_positions = self.pending[index], self.next_positions[index]
        self.requests = [self.requests[r] for r in rows]

    @property
    def block(self) -> DraftInput:
        """The slots the proposer has not read yet: the last verify block and the plain steps after it."""
        if self._plain_steps:
            batch_size, num_steps = self.pending.shape[0], len(self._plain_steps)
            kv_mask = torch.cat([self._block.kv_mask, self._block.kv_mask.new_ones(batch_size, num_steps)], dim=1)
            self._block = with_plain_steps(self._block, self._plain_steps, self.next_positions, kv_mask)
            self.next_positions = self.next_positions + num_steps
            self._plain_steps = []
        return self._block

    def advance_plain(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """After a plain step (k = 0): the thinker read the pending token; next_ids [B] is the token it
        sampled (any id on rows not decoded), hidden [B, H] the read token's row after the final norm
        (zeros on rows not decoded). Kept as they are until the proposer reads `block`, so a plain step
        costs no tensor work here."""
        self._plain_steps.append((self.pending, next_ids, hidden))
        self.pending = next_ids

    def advance(
        self, verify_ids: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, num_kept: torch.Tensor
    ) -> None:
        """After a verify that read `block`: verify_ids [B, k+1] (the pending token, the k >= 1 drafts),
        tokens [B, k+1] (−1 padded), hidden [B, k+1, H] (zeros on rows not verified), num_kept [B] (slots
        the thinker kept; 1 on rows not verified)."""
        if self._plain_steps:
            raise ValueError("advance: the proposer has not read the plain steps' slots (read `block` first)")
        width = int(num_kept.max())
        offsets = torch.arange(verify_ids.shape[1], device=verify_ids.device)
        positions = self.next_positions[:, None] + offsets  # [B, k+1]
        kv_mask = torch.cat([self._block.kv_mask, (offsets[None, :width] < num_kept[:, None]).long()], dim=1)
        last_index = num_kept - 1  # [B]
        self._block = DraftInput(
            input_ids=verify_ids[:, :width], next_ids=tokens[:, :width].clamp(min=0), hidden=hidden[:, :width],
            position_ids=positions[:, :width], kv_mask=kv_mask, last_index=last_index,
        )
        self.pending = tokens[torch.arange(tokens.shape[0], device=tokens.device), last_index].clamp(min=0)
        self.next_positions = self.next_positions + num_kept


def draft_sampling(sampling: list[SamplingParams | None]) -> SamplingParams | list[SamplingParams]:
    """What a proposer draws the rows' drafts with: the one sampling of every row, else one per row."""
    params = [s or GREEDY for s in sampling]
    return params[0] if all(p == params[0] for p in params) else params


def verify(
    logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, sampling: list[SamplingParams | None],
    generators: list[torch.Generator | None], check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, k+1, V] after each verify row, draft_tokens [R, k], draft_probs [R, k, V], each row's
    sampling (None = greedy) and generator → tokens [R, k+1] (accepted drafts, then the recovered or
    bonus token, −1 padded) and num_emitted [R] in 1..k+1 (`rejection_sample`; greedy rows accept while
    the draft is the argmax and draw nothing). k >= 1: a plain step is `ThinkerRun`'s own. check_values:
    `rejection_sample`'s (False for drafts of our own `MTPProposer`)."""
    params = [s or GREEDY for s in sampling]
    if all(p.is_greedy for p in params):
        return greedy_verify(logits.argmax(dim=-1), draft_tokens.long())
    target_probs = torch.stack([probs_from_logits(logits[r].float(), p) for r, p in enumerate(params)])  # [R, k+1, V]
    greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
    return rejection_sample(
        target_probs, draft_tokens, draft_probs, greedy=greedy, generators=list(generators), check_values=check_values
    )
