"""An explicit thinker decode loop over an omni thinker (Qwen3-Omni, Qwen2.5-Omni) on packed weights
(`PackedDecoder`).

Each request has its own KV slot: the prefill runs per request (no padding), then one forward per
step over the requests still writing. Every forward's rows of the layer-0 input embeddings and of
the hidden state at `accept_hidden_layer` (Qwen3-Omni: a middle layer; Qwen2.5-Omni: the number of
layers, the last layer after the final norm) are handed out with the token, which is what the talker
needs. As in `generate`, there is no forward after a request's last token, so a request with P
prompt and N output tokens leaves P + N − 1 captured rows.

    run = ThinkerRun(model.thinker, [[256, 262, 10, 72, 257, 10, 256, 263, 10]], accept_hidden_layer=1,
                     eos_token_ids={257}, max_new_tokens=64)
    while not run.is_finished:
        for event in run.step():   # ThinkerEvent(index, token_id, embeds [n, D], hidden [n, D], finish_reason)
            ...

Prefix reuse (`prefill_block`, `prefixes`, `keeps_prefix`): with a prefill block B every prompt is
prefilled in blocks of B positions counted from position 0 (the last one shorter), one forward each; a
request that keeps its prefix leaves its prompt's whole blocks as a `PrefixRows` (`kept_prefixes`), and a
later request given that prefix loads the KV of the whole blocks its prompt shares (ids and input rows
equal: the same text and the same media content) and prefills from there. Every block is then the same
forward on the same inputs either way, so a reused prefix gives the same bits as prefilling it again.

Speculative mode (`speculation=ThinkerSpeculation(head_or_proposer, k)`, see
`omnimtp.spec_decode.thinker_spec`): after the prefill, each step drafts k tokens per request, verifies
them in one forward over [last, d1..dk] and emits one event per accepted token, in order, each with the
one verify row that produced it — (row(last), d1), (row(d1), d2), ..., (row(d_a), bonus) — so the events
read as a run of one-token steps; rows of rejected drafts are rolled back and never handed out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from omnimtp.media import MediaInputs
from omnimtp.mtp.head import MTPHead
from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime.kv_cache import SavedSlot
from omnimtp.runtime.ops import linear
from omnimtp.sampling import (
    QWEN3_OMNI_THINKER_SAMPLING,
    SamplingParams,
    TokenLogprob,
    check_num_logprobs,
    sample,
    token_logprob,
)
from omnimtp.spec_decode.adaptive import (
    DEFAULT_MAX_DRAFT_TOKENS,
    DraftCosts,
    DraftCostTable,
    FixedDrafts,
    batch_buckets,
    calibrate,
)
from omnimtp.spec_decode.cost_cache import cost_fingerprint
from omnimtp.spec_decode.generate import SpecStats
from omnimtp.spec_decode.proposer import Proposer, check_drafts
from omnimtp.spec_decode.thinker_spec import DraftLayout, ThinkerSpeculation, draft_sampling, verify


@dataclass
class ThinkerEvent:
    """What one thinker forward produced for one request.

    token_id: the token it sampled, or None when the request was already finished.
    embeds, hidden: the rows of that forward ([P, D] at prefill, [1, D] after, [0, D] when finished).
    finish_reason: "stop" or "length" on the step that finished the request, else None.
    logprob: the token's `TokenLogprob` when the request asked for logprobs, else None."""

    index: int
    token_id: int | None
    embeds: torch.Tensor
    hidden: torch.Tensor
    finish_reason: str | None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class PrefixRows:
    """A prompt prefix's thinker state, whole prefill blocks of `block` positions: what a later prompt that
    starts the same way reuses instead of prefilling it again.

    ids: the prefix's prompt ids; kv: its KV (`SavedSlot`, length len(ids)); embeds, hidden: its input rows
    and the rows at accept_hidden_layer [N, D] (what the talker reads of the prompt); final: its rows after
    the final norm [N, D] when a speculative run kept them (its drafter reads them), else None. The prefix
    holds no image or video row (M-RoPE moves positions there), so its positions are its cache indices."""

    ids: tuple[int, ...]
    kv: SavedSlot
    embeds: torch.Tensor
    hidden: torch.Tensor
    final: torch.Tensor | None
    block: int

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def num_bytes(self) -> int:
        tensors = (self.kv.kv, self.embeds, self.hidden) + (() if self.final is None else (self.final,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def matching_rows(self, prompt: list[int], embeds: torch.Tensor, max_rows: int) -> int:
        """How many of its rows a prompt with input rows embeds [P, D] reuses: the whole blocks, up to
        max_rows, before the first position where the ids or the input rows differ (two audios behind
        the same placeholder ids differ in their rows)."""
        num_rows = min(self.num_rows, len(prompt), max_rows)
        if num_rows < self.block:
            return 0
        same = torch.tensor(self.ids[:num_rows]) == torch.tensor(prompt[:num_rows])  # [n]
        same &= (self.embeds[:num_rows] == embeds[:num_rows]).all(dim=-1).cpu()
        differing = (~same).nonzero()
        common = int(differing[0]) if len(differing) else num_rows
        return common // self.block * self.block


class ThinkerRun:
    """A batch of requests decoded in lockstep; finished requests are no longer forwarded.

    thinker: transformers' `Qwen3OmniMoeThinkerForConditionalGeneration` or
    `Qwen2_5OmniThinkerForConditionalGeneration` (the same layout: `model.language_model`, `lm_head`,
    `get_audio_features`, `get_image_features`, `get_rope_index`). decoder: the packed weights
    of its text model (`PackedDecoder.from_module(thinker.model.language_model)`), made here when
    None; pass one to share it between runs. speculation: speculative steps (see the module docstring);
    `spec_stats[i]` then counts request i's drafts and acceptances. prefill_block: prompts prefill in blocks
    of that many positions (None: each in one forward); prefixes[i]: a `PrefixRows` of that block size that
    request i may start from (`reused_rows[i]` says how many rows it took); keeps_prefix[i]: request i keeps
    its prompt's whole blocks (`kept_prefixes[i]` after the first step). plain_start_steps: a speculative
    run's first steps after the prefill that draft nothing, whatever k or the controller would choose: a new
    request's first reply rows, what its talker prefill and first frame wait for, come at a plain step's cost
    (the engine takes its start steps plain); the same for every row, so a seeded row stays what it is alone.
    logprobs[i]: None (request i's events carry no logprob, and nothing is computed for it) or n >= 0: each of its
    events carries the token's `TokenLogprob` from the logits row it was drawn from, with n alternatives.
    prefill_decoder: the same layers' weights in another form that the prompts' forwards run on (a "w8a8" copy for
    many rows: Qwen3-ASR's `int8_compute`), the steps on decoder (the first token still from decoder's head);
    each prompt is forwarded alone, so a request's rows do not depend on the batch. Not with speculation."""

    def __init__(
        self,
        thinker,
        prompts: list[list[int]],
        *,
        accept_hidden_layer: int,
        eos_token_ids: set[int],
        max_new_tokens: int,
        sampling: list[SamplingParams | None] | None = None,
        generators: list[torch.Generator | None] | None = None,
        decoder: PackedDecoder | None = None,
        media: list[MediaInputs | None] | None = None,
        speculation: ThinkerSpeculation | None = None,
        prefill_block: int | None = None,
        prefixes: list[PrefixRows | None] | None = None,
        keeps_prefix: list[bool] | None = None,
        plain_start_steps: int = 0,
        logprobs: list[int | None] | None = None,
        prefill_decoder: PackedDecoder | None = None,
    ):
        batch_size = len(prompts)
        self.logprobs = list(logprobs) if logprobs is not None else [None] * batch_size
        if len(self.logprobs) != batch_size:
            raise ValueError(f"logprobs must be a list of {batch_size} entries (None or an integer)")
        for value in self.logprobs:
            check_num_logprobs(value)
        if isinstance(plain_start_steps, bool) or not isinstance(plain_start_steps, int) or plain_start_steps < 0:
            raise ValueError(f"plain_start_steps must be an integer >= 0, got {plain_start_steps!r}")
        self._plain_steps_left = plain_start_steps
        if batch_size == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one non-empty prompt")
        if prefill_block is not None and (
            isinstance(prefill_block, bool) or not isinstance(prefill_block, int) or prefill_block < 1
        ):
            raise ValueError(f"prefill_block must be None or an integer >= 1, got {prefill_block!r}")
        self.prefill_block = prefill_block
        self.prefixes = list(prefixes) if prefixes is not None else [None] * batch_size
        if len(self.prefixes) != batch_size or any(
            p is not None and (not isinstance(p, PrefixRows) or p.block != prefill_block) for p in self.prefixes
        ):
            raise ValueError(f"prefixes must be a list of {batch_size} PrefixRows of block {prefill_block} or None")
        self.keeps_prefix = list(keeps_prefix) if keeps_prefix is not None else [False] * batch_size
        if len(self.keeps_prefix) != batch_size or (prefill_block is None and any(self.keeps_prefix)):
            raise ValueError(f"keeps_prefix must be a list of {batch_size} booleans, all False without a prefill_block")
        self.reused_rows = [0] * batch_size
        self.kept_prefixes: list[PrefixRows | None] = [None] * batch_size
        self.media = list(media) if media is not None else [None] * batch_size
        if len(self.media) != batch_size or any(m is not None and not isinstance(m, MediaInputs) for m in self.media):
            raise ValueError(f"media must be a list of {batch_size} MediaInputs or None")
        if decoder is not None and not isinstance(decoder, PackedDecoder):
            raise ValueError(f"decoder must be None or a PackedDecoder, got {type(decoder).__name__}")
        if prefill_decoder is not None and (
            not isinstance(prefill_decoder, PackedDecoder) or speculation is not None
            or decoder is None or (prefill_decoder.num_layers, prefill_decoder.num_kv_heads, prefill_decoder.head_dim,
                                   prefill_decoder.dtype) != (decoder.num_layers, decoder.num_kv_heads,
                                                              decoder.head_dim, decoder.dtype)
        ):
            raise ValueError("prefill_decoder must be None, or a PackedDecoder of decoder's layers, heads and dtype "
                             "(its weights in another form) in a run without speculation")
        num_layers = thinker.config.text_config.num_hidden_layers
        if not 0 <= accept_hidden_layer <= num_layers:
            raise ValueError(f"accept_hidden_layer must be in [0, {num_layers}], got {accept_hidden_layer!r}")
        self.thinker = thinker
        self.decoder = decoder or PackedDecoder.from_module(thinker.model.language_model)
        self.prefill_decoder = prefill_decoder or self.decoder  # the prompts' forwards; the steps run on decoder
        self.accept_hidden_layer = accept_hidden_layer
        self.eos_token_ids = set(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.sampling = list(sampling) if sampling is not None else [None] * batch_size
        self.generators = list(generators) if generators is not None else [None] * batch_size
        self.output_ids: list[list[int]] = [[] for _ in prompts]
        self.finish_reasons: list[str | None] = [None] * batch_size
        self.prompts = [list(p) for p in prompts]
        capacity = max(len(p) for p in prompts) + max_new_tokens
        self.kv = KVCache(self.decoder, batch_size, capacity=capacity)  # slot i = request i
        self._is_prefill = True
        if speculation is not None and not isinstance(speculation, ThinkerSpeculation):
            raise ValueError(f"speculation must be None or a ThinkerSpeculation, got {type(speculation).__name__}")
        self.speculation = speculation
        self.spec_stats: list[SpecStats] | None = None
        if speculation is not None:
            speculation.check(thinker)
            costs = None
            if speculation.is_adaptive and speculation.draft_costs is None:  # measured once per bucket, then reused
                is_sampled = any(p is not None and not p.is_greedy for p in self.sampling)
                costs = calibrate_thinker_cost_table(
                    thinker, self.decoder, speculation, accept_hidden_layer, batch_size, is_sampled
                )
            self.controller = speculation.new_controller(costs, batch_size)
            k = self.controller.max_draft_tokens
            # made by the first step that drafts (`_drafter`), off the path to a new request's first reply rows
            self.proposer: Proposer | None = None
            # a caller's Proposer: its drafts are checked
            self.checks_drafts = not isinstance(speculation.drafter, MTPHead)
            # finished rows leave its view (an `MTPProposer` or a copy of the caller's has keep_rows where the
            # drafter has)
            self.drops_rows = not self.checks_drafts or callable(getattr(speculation.drafter, "keep_rows", None))
            self.spec_stats = [SpecStats(num_draft_tokens=k, accepted_per_position=[0] * k) for _ in prompts]
            if speculation.is_adaptive:
                for stats in self.spec_stats:
                    stats.draft_costs = self.controller.costs.for_batch(batch_size).step
                    stats.draft_costs_by_batch = self.controller.costs.to_dict()
            self._layout: DraftLayout | None = None

    @property
    def is_finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def step(self, *, plain: bool = False) -> list[ThinkerEvent]:
        """One forward for every unfinished request (the first step: each request's prefill) → one
        event per request. plain: with `auto` drafts, a plain step (no drafts) instead of the controller's
        choice, the shortest step, for a caller that has a request waiting on it; a fixed k drafts as
        always (its seeded requests' tokens do not depend on when others arrive)."""
        active = [i for i, reason in enumerate(self.finish_reasons) if reason is None]
        device = self.decoder.device
        embed_tokens = self.thinker.get_input_embeddings()
        is_plain_spec_step = self.speculation is not None and not self._is_prefill and bool(active)
        if is_plain_spec_step:  # k for the rows this step runs: finished requests are not forwarded
            k = 0
            if self._plain_steps_left:
                self._plain_steps_left -= 1
            elif not (plain and self.speculation.is_adaptive):
                k = self.controller.choose([reason is None for reason in self.finish_reasons])
            if k > 0:
                return self._speculative_step(active, k)
            started = time.perf_counter()  # k = 0: the plain step below, recorded for the drafter after it
        rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}  # i → embeds, hidden, logits
        picked: dict[int, int] = {}  # i → its greedy token, taken from the screened head (its logits then None)
        final_rows: dict[int, torch.Tensor] = {}  # i → [P, D] after the final norm (speculative runs)
        rope_rows: dict[int, torch.Tensor] = {}  # i → [3, P] M-RoPE ids of a prefill with images / video
        with torch.no_grad():
            if self._is_prefill:
                for i in active:
                    prefill = multimodal_prefill(self.thinker, self.prompts[i], self.media[i], device)
                    hidden, logits, final = self._prefill(i, prefill)
                    rows[i] = (prefill.embeds[0], hidden, logits)
                    if final is not None:
                        final_rows[i] = final
                    if prefill.rope_positions is not None:
                        rope_rows[i] = prefill.rope_positions[:, 0]
            elif active:
                ids = torch.tensor([self.output_ids[i][-1] for i in active], device=device)[:, None]  # [R, 1]
                embeds = embed_tokens(ids)  # [R, 1, D]
                screened = self._screened_head(active)
                hidden, logits, final = self._forward(embeds, active, head=screened is None)
                if screened is not None:  # logits holds the final norm's rows [R, D]: the int8 head's tokens
                    picked = dict(zip(active, screened.greedy(logits).tolist(), strict=True))
                for r, i in enumerate(active):
                    rows[i] = (embeds[r], hidden[r], None if screened is not None else logits[r])
        is_prefill, self._is_prefill = self._is_prefill, False
        sampled = []  # each row with its own sampling and generator, on the device; read back at once
        sampled_rows = [i for i in rows if i not in picked]
        for i in sampled_rows:
            generator = [self.generators[i]] if self.generators[i] is not None else None
            sampled.append(sample(rows[i][2][None].float(), self.sampling[i], generator))
        sampled_ids = torch.cat(sampled) if sampled else None  # [R]
        token_ids = dict(zip(sampled_rows, sampled_ids.tolist(), strict=True)) if sampled else {}
        token_ids.update(picked)
        events = []
        for i in range(len(self.output_ids)):
            if i not in rows:
                empty = torch.zeros((0, self.decoder.hidden_size), dtype=self.decoder.dtype, device=device)
                events.append(ThinkerEvent(i, None, empty, empty, None))
                continue
            row_embeds, row_hidden, row_logits = rows[i]
            token_id = token_ids[i]
            self.output_ids[i].append(token_id)
            if token_id in self.eos_token_ids:
                self.finish_reasons[i] = "stop"
            elif len(self.output_ids[i]) >= self.max_new_tokens:
                self.finish_reasons[i] = "length"
            logprob = None if self.logprobs[i] is None else token_logprob(row_logits, token_id, self.logprobs[i])
            events.append(ThinkerEvent(i, token_id, row_embeds, row_hidden, self.finish_reasons[i], logprob))
        if is_plain_spec_step:
            self._record_plain_step(active, sampled_ids, final, started)
        if not is_prefill or self.speculation is None:
            return events
        positions = [torch.arange(len(p), device=device) + self.kv.rope_offsets[i] for i, p in enumerate(self.prompts)]
        first_ids = [ids[0] for ids in self.output_ids]
        self._layout = DraftLayout(
            self.prompts, first_ids, [final_rows[i] for i in range(len(self.prompts))], positions,
            [rope_rows.get(i) for i in range(len(self.prompts))],
        )
        return events

    def _prefill(self, i: int, prefill: Prefill) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Request i's prompt into its slot → hidden at accept_hidden_layer [P, D], the last row's logits [V],
        the rows after the final norm [P, D] (speculative runs, else None). In one forward, or with a prefill
        block: the reused prefix's KV loaded, then the rest in blocks (see the module docstring)."""
        prompt, block = self.prompts[i], self.prefill_block
        if block is None:
            hidden, logits, final = self._forward(
                prefill.embeds, [i], prefill.rope_positions, prefill.layer_adds, decoder=self.prefill_decoder
            )
            return hidden[0], logits[0], None if final is None else final[0]
        num_rows, embeds = len(prompt), prefill.embeds[0]  # [P, D]
        prefix = self.prefixes[i]
        if prefix is not None and self.speculation is not None and prefix.final is None:
            prefix = None  # its drafter would need the prefix's final rows
        # at least one row is forwarded: the first token comes from the last row's logits
        num_reused = 0 if prefix is None else prefix.matching_rows(prompt, embeds, num_rows - 1)
        hidden_parts, final_parts = [], []
        if num_reused:
            self.kv.load(i, prefix.kv.head(num_reused))
            hidden_parts.append(prefix.hidden[:num_reused])
            if prefix.final is not None:
                final_parts.append(prefix.final[:num_reused])
        self.reused_rows[i] = num_reused
        for start in range(num_reused, num_rows, block):
            stop = min(start + block, num_rows)
            hidden, logits, final = self._forward(
                prefill.embeds[:, start:stop], [i],
                None if prefill.rope_positions is None else prefill.rope_positions[:, :, start:stop],
                tuple(add[:, start:stop] for add in prefill.layer_adds), decoder=self.prefill_decoder,
            )
            hidden_parts.append(hidden[0])
            if final is not None:
                final_parts.append(final[0])
        if prefill.rope_positions is not None:  # decoding continues after the prompt's largest position
            self.kv.rope_offsets[i] = int(prefill.rope_positions.max()) + 1 - num_rows
        hidden = torch.cat(hidden_parts)  # [P, D]
        final = torch.cat(final_parts) if final_parts else None
        visual_ids = {self.thinker.config.image_token_id, self.thinker.config.video_token_id}
        num_plain = next((p for p, token in enumerate(prompt) if token in visual_ids), num_rows)
        num_kept = num_plain // block * block
        if num_kept and self.keeps_prefix[i]:
            saved = self.kv.save(i, num_kept)
            self.kept_prefixes[i] = PrefixRows(
                tuple(prompt[:num_kept]), SavedSlot(saved.kv, num_kept, 0), embeds[:num_kept].clone(),
                hidden[:num_kept].clone(), None if final is None else final[:num_kept].clone(), block,
            )
        return hidden, logits[0], final

    def _record_plain_step(
        self, active: list[int], sampled_ids: torch.Tensor | None, final: torch.Tensor | None, started: float
    ) -> None:
        """After a plain step of a speculative run (the controller chose k = 0): sampled_ids [R] and final
        [R, 1, D] of the active rows. The drafter reads the step's slots with the next step that drafts
        (`DraftLayout.advance_plain`); the stats count it."""
        layout = self._drop_finished_rows()
        requests = layout.requests
        if requests == active:
            next_ids, rows = sampled_ids, final.view(len(active), -1)  # [L], [L, D]
        else:  # rows not decoded: any id, zero hidden
            num_rows = len(requests)
            next_ids = layout.pending.new_zeros(num_rows)
            rows = torch.zeros((num_rows, self.decoder.hidden_size), dtype=self.decoder.dtype, device=next_ids.device)
            decoded = [(p, active.index(i)) for p, i in enumerate(requests) if i in active]
            if decoded:
                to = torch.tensor([p for p, _ in decoded], device=next_ids.device)
                source = torch.tensor([r for _, r in decoded], device=next_ids.device)
                next_ids[to], rows[to] = sampled_ids[source], final[source, 0]
        layout.advance_plain(next_ids, rows)
        step_time = time.perf_counter() - started
        for i in active:
            stats = self.spec_stats[i]
            stats.num_steps += 1
            stats.num_row_steps += 1
            stats.draft_histogram[0] = stats.draft_histogram.get(0, 0) + 1
            stats.num_generated_tokens += 1
            stats.verify_time_s += step_time
            stats.total_time_s += step_time

    def _drop_finished_rows(self) -> DraftLayout:
        """The drafter's layout without the rows of finished requests, where the proposer can drop rows
        (`keep_rows`); else as it is (those rows ride along)."""
        layout = self._layout
        if self.drops_rows and any(self.finish_reasons[i] is not None for i in layout.requests):
            kept = [p for p, i in enumerate(layout.requests) if self.finish_reasons[i] is None]
            if kept:
                layout.keep_rows(kept)
                if self.proposer is not None:  # one made later has read no rows yet
                    self.proposer.keep_rows(kept)
        return layout

    def _drafter(self) -> Proposer:
        """The run's proposer, made by its first drafting step (a fresh proposer holds no rows' state, so rows
        the layout dropped before are no concern of it)."""
        if self.proposer is None:
            self.proposer = self.speculation.new_proposer()
        return self.proposer

    def _speculative_step(self, active: list[int], k: int) -> list[ThinkerEvent]:
        """Draft k >= 1 tokens for the drafter's rows, verify the unfinished rows' drafts in one forward, roll
        back the rejected ones → the accepted tokens' events, in request order (see the module docstring)."""
        layout, device = self._drop_finished_rows(), self.decoder.device
        batch_size, requests = len(self.output_ids), layout.requests
        num_rows = len(requests)  # the drafter's rows: the unfinished requests (and finished ones riding along)
        is_active = [reason is None for reason in self.finish_reasons]
        started = time.perf_counter()
        with torch.no_grad():
            sampling = [self.sampling[i] for i in requests]
            generators = (
                None if all(s is None or s.is_greedy for s in sampling) else [self.generators[i] for i in requests]
            )
            draft_tokens, draft_probs = self._drafter().propose(
                layout.block, k, draft_sampling(sampling), generators
            )  # [L, k], [L, k, V]
            if self.checks_drafts:
                check_drafts(draft_tokens, num_rows, k, self.thinker.get_output_embeddings().weight.shape[0])
            drafted = time.perf_counter()
            verify_ids = torch.cat([layout.pending[:, None], draft_tokens.long()], dim=1)  # [L, k+1]
            num_kept = torch.ones(num_rows, dtype=torch.long, device=device)  # [L]
            tokens = verify_ids.new_full(verify_ids.shape, -1)  # [L, k+1]
            final_rows = torch.zeros(
                (num_rows, k + 1, self.decoder.hidden_size), dtype=self.decoder.dtype, device=device
            )
            if active:
                index = torch.tensor([requests.index(i) for i in active], device=device)  # their rows
                embeds = self.thinker.get_input_embeddings()(verify_ids[index])  # [R, k+1, D]
                starts = [self.kv.lengths[i] for i in active]
                # [R, k+1, D], [R, k+1, V], [R, k+1, D]
                hidden, logits, final = self._forward(embeds, active, all_logits=True)
                row_tokens, num_emitted = verify(
                    logits, draft_tokens[index], draft_probs[index],
                    [self.sampling[i] for i in active], [self.generators[i] for i in active],
                    check_values=self.checks_drafts,  # our own drafts are valid by construction
                )  # [R, k+1], [R]
                lengths = list(self.kv.lengths)
                for r, i in enumerate(active):
                    lengths[i] = starts[r] + int(num_emitted[r])  # last + the accepted drafts; the rest rolls back
                self.kv.restore(tuple(lengths))
                num_kept[index], tokens[index], final_rows[index] = num_emitted, row_tokens, final
        verified = time.perf_counter()
        accepted = [0] * batch_size  # per request
        for p, count in enumerate(num_kept.tolist()):
            accepted[requests[p]] = count - 1
        self.controller.update(k, accepted, is_active)
        layout.advance(verify_ids, tokens, final_rows, num_kept)
        emitted = dict(zip(active, row_tokens.tolist(), strict=True)) if active else {}
        events = []
        for i in range(batch_size):
            if i not in emitted:
                empty = torch.zeros((0, self.decoder.hidden_size), dtype=self.decoder.dtype, device=device)
                events.append(ThinkerEvent(i, None, empty, empty, None))
                continue
            r = active.index(i)
            num_accepted = accepted[i]
            stats = self.spec_stats[i]
            stats.num_steps += 1
            stats.num_row_steps += 1
            stats.num_drafted += k
            stats.draft_histogram[k] = stats.draft_histogram.get(k, 0) + 1
            stats.num_accepted += num_accepted
            for position in range(num_accepted):
                stats.accepted_per_position[position] += 1
            stats.draft_time_s += drafted - started
            stats.verify_time_s += verified - drafted
            for j, token_id in enumerate(emitted[i][: num_accepted + 1]):
                self.output_ids[i].append(token_id)
                stats.num_generated_tokens += 1
                if token_id in self.eos_token_ids:
                    self.finish_reasons[i] = "stop"
                elif len(self.output_ids[i]) >= self.max_new_tokens:
                    self.finish_reasons[i] = "length"
                logprob = None if self.logprobs[i] is None else token_logprob(logits[r, j], token_id, self.logprobs[i])
                events.append(ThinkerEvent(
                    i, token_id, embeds[r, j : j + 1], hidden[r, j : j + 1], self.finish_reasons[i], logprob
                ))
                if self.finish_reasons[i] is not None:
                    break  # the rest of the accepted run is past the request's end
        step_time = time.perf_counter() - started
        for i in emitted:
            self.spec_stats[i].total_time_s += step_time
        return events

    def _screened_head(self, active: list[int]):
        """The decoder's screened head (`PackedDecoder.screened_lm_head`) where a step of the rows `active` may
        take its tokens from it: every row greedy without log-probabilities, in a run without speculation; else
        None."""
        head = self.decoder.screened_lm_head
        if head is None or self.speculation is not None:
            return None
        if any(self.logprobs[i] is not None or not (self.sampling[i] is None or self.sampling[i].is_greedy)
               for i in active):
            return None
        return head

    def _forward(
        self, embeds: torch.Tensor, slots: list[int], rope_positions=None, layer_adds=(), all_logits: bool = False,
        decoder: PackedDecoder | None = None, head: bool = True,
    ):
        """embeds [R, T, D] → hidden at accept_hidden_layer [R, T, D], logits [R, V] at the last position
        ([R, T, V] with all_logits; without `head`, the rows after the final norm they come from, [R, D] or
        [R, T, D]) and, in a speculative run, every row after the final norm [R, T, D] (else None): what the MTP
        head reads. decoder: the weights it runs on (default the run's decoder; a prompt's forward runs on
        prefill_decoder)."""
        out = decoder_forward(
            decoder or self.decoder, self.kv, embeds, slots, capture_layer=self.accept_hidden_layer,
            rope_positions=rope_positions, layer_adds=layer_adds, all_final=self.speculation is not None,
        )
        last = out.final if all_logits else out.last_hidden
        if not head:
            return out.captured, last, out.final
        if self.decoder.quantized_lm_head is not None:  # a quantized thinker's int8 head
            logits = linear(last, None, packed=self.decoder.quantized_lm_head)  # [R, V] or [R, T, V]
        else:
            logits = torch.nn.functional.linear(last, self.thinker.lm_head.weight)
        return out.captured, logits, out.final


# what sampled runs' costs (and their prior acceptance) are measured with: the thinker's defaults, which most
# sampled requests use (requests at higher temperatures accept fewer drafts than the prior assumes at first)
CALIBRATION_SAMPLING = QWEN3_OMNI_THINKER_SAMPLING
CALIBRATION_TOKENS = 48  # new tokens per row after which a calibration run is replaced by a fresh one


def calibrate_thinker_costs(
    thinker, decoder: PackedDecoder, speculation: ThinkerSpeculation, accept_hidden_layer: int, batch_size: int,
    is_sampled: bool, model_path: str | os.PathLike | None = None,
) -> DraftCosts:
    """`omnimtp.spec_decode.adaptive.calibrate` for the thinker: steps of `ThinkerRun`, each k in turn step by
    step, on a fixed 16-token prompt per row (and the drafts' acceptance in them, the prior of an auto run), at
    this batch size, greedy or sampled (`CALIBRATION_SAMPLING`: one measurement serves every sampled
    request, whatever its temperature), measured once per thinker and key, then reused. One run serves several
    cycles (its controller swapped every step; a fresh run once its rows hold CALIBRATION_TOKENS new tokens): the
    thinker's prefill runs one request at a time, and a prefill per measurement took most of the time at 16
    rows. Kept on disk for the next process (`omnimtp.spec_decode.cost_cache`; model_path: the directory the
    omni model was loaded from)."""
    vocab = thinker.get_output_embeddings().weight.shape[0]
    prompt = [(7 * i + 3) % vocab for i in range(16)]
    run_sampling = [CALIBRATION_SAMPLING if is_sampled else None] * batch_size
    max_k = DEFAULT_MAX_DRAFT_TOKENS
    runs: list[ThinkerRun] = []

    def time_cycle(ks: list[int]) -> list[tuple[float, int, int]]:
        if not runs or max(len(ids) for ids in runs[-1].output_ids) > CALIBRATION_TOKENS:
            runs[:] = [ThinkerRun(
                thinker, [prompt] * batch_size, accept_hidden_layer=accept_hidden_layer, eos_token_ids=set(),
                # room for a cycle's steps: no row may finish (the batch would shrink)
                max_new_tokens=CALIBRATION_TOKENS + (len(ks) + 1) * (max_k + 1), sampling=run_sampling,
                decoder=decoder, speculation=ThinkerSpeculation(speculation.drafter, max_k),
                generators=(
                    [torch.Generator(device=decoder.device).manual_seed(b) for b in range(batch_size)] if is_sampled
                    else None
                ),
            )]
            runs[-1].step()  # the prefill
        run = runs[-1]
        steps = []
        for k in ks:
            run.controller = FixedDrafts(k)  # k = 0: the plain steps of a speculative run
            before = _draft_counts(run, k)
            start = time.perf_counter()
            run.step()
            seconds = time.perf_counter() - start
            accepted, verified = (after - first for after, first in zip(_draft_counts(run, k), before, strict=True))
            steps.append((seconds, accepted, verified))
        return steps

    key = (id(speculation.drafter), batch_size, is_sampled, str(decoder.device))
    def fingerprint() -> dict:
        return cost_fingerprint(thinker, speculation.drafter, device=decoder.device, model_path=model_path, key={
            "loop": "thinker", "batch_size": batch_size, "sampled": is_sampled, "dtype": str(decoder.dtype),
            "row_kernel": decoder.row_kernel is not None, "accept_hidden_layer": accept_hidden_layer,
            "max_draft_tokens": DEFAULT_MAX_DRAFT_TOKENS,
        })

    return calibrate(thinker, key, time_cycle, DEFAULT_MAX_DRAFT_TOKENS, fingerprint)


def _draft_counts(run: ThinkerRun, k: int) -> tuple[int, int]:
    """The drafts a run's steps of k drafts accepted and verified so far (accepted ones and each row-step's
    first rejection), summed over its rows; (0, 0) for k = 0."""
    if k == 0:
        return 0, 0
    accepted = sum(stats.num_accepted for stats in run.spec_stats)
    rejections = sum(stats.num_row_steps - stats.accepted_per_position[k - 1] for stats in run.spec_stats)
    return accepted, accepted + rejections


def calibrate_thinker_cost_table(
    thinker, decoder: PackedDecoder, speculation: ThinkerSpeculation, accept_hidden_layer: int, max_batch_size: int,
    is_sampled: bool, model_path: str | os.PathLike | None = None,
) -> DraftCostTable:
    """`calibrate_thinker_costs` at every batch-size bucket up to max_batch_size (`batch_buckets`): what a
    run of up to max_batch_size requests decides with as its requests finish. A server measures its
    buckets at start-up (`Qwen3OmniFamily.calibrate_speculation`), so no request waits for a measurement."""
    return DraftCostTable(tuple(
        (rows, calibrate_thinker_costs(thinker, decoder, speculation, accept_hidden_layer, rows, is_sampled,
                                       model_path))
        for rows in batch_buckets(max_batch_size)
    ))


@dataclass
class Prefill:
    """A prompt's thinker prefill inputs: embeds [1, P, D] (encoder rows scattered in), rope_positions
    [3, 1, P] M-RoPE ids (None: the cache positions, text and audio), layer_adds: deepstack visual
    features [1, P, D] added after layers 0, 1, ... (zero off the visual rows)."""

    embeds: torch.Tensor
    rope_positions: torch.Tensor | None = None
    layer_adds: tuple[torch.Tensor, ...] = ()


@torch.no_grad()
def multimodal_prefill(thinker, prompt: list[int], media: MediaInputs | None, device) -> Prefill:
    """The prefill of one prompt as transformers' thinker model's forward builds it (Qwen3-Omni's and
    Qwen2.5-Omni's alike; Qwen2.5 has no deepstack features): the token
    embeddings; transformers' own audio and vision encoders on the media tensors, their rows in place of
    the `<|audio_pad|>` / `<|image_pad|>` / `<|video_pad|>` ids (one row per id, else ValueError); the
    deepstack features of images and videos; M-RoPE positions from `get_rope_index` when there are images
    or videos (audio and text advance all three axes together: the 1-D cache positions)."""
    config = thinker.config
    ids = torch.tensor([prompt], device=device)  # [1, P]
    embeds = thinker.get_input_embeddings()(ids)  # [1, P, D]
    media = media or MediaInputs()
    tokens = set(prompt)
    for name, token_id, values in (
        ("audio", config.audio_token_id, media.input_features),
        ("image", config.image_token_id, media.pixel_values),
        ("video", config.video_token_id, media.pixel_values_videos),
    ):
        if values is None and token_id in tokens:
            raise ValueError(f"prompt: it holds {name} placeholder ids but no {name} inputs were given")
    if not media.has_audio and not media.has_vision:
        return Prefill(embeds)
    if media.has_audio:
        # the audio tower: transformers' omni thinkers keep it in their model, Qwen3-ASR's thinker beside it
        audio_tower = getattr(thinker, "audio_tower", None) or thinker.model.audio_tower
        audio = thinker.get_audio_features(
            media.input_features.to(device, audio_tower.dtype), media.feature_attention_mask.to(device),
            return_dict=True,
        ).last_hidden_state
        embeds = _scatter(embeds, ids == config.audio_token_id, audio, "audio")
    visual_masks, visual_levels = [], []
    for values, grid, token_id, name in (
        (media.pixel_values, media.image_grid_thw, config.image_token_id, "image"),
        (media.pixel_values_videos, media.video_grid_thw, config.video_token_id, "video"),
    ):
        if grid is None:
            continue
        encode = thinker.get_image_features if name == "image" else thinker.get_video_features
        out = encode(values.to(device), grid.to(device), return_dict=True)
        mask = ids == token_id
        embeds = _scatter(embeds, mask, torch.cat(out.pooler_output), name)
        visual_masks.append(mask)
        visual_levels.append([torch.cat(level) for level in getattr(out, "deepstack_features", None) or ()])
    layer_adds = []
    for levels in zip(*visual_levels, strict=True):  # one deepstack level: its image rows and its video rows
        add = torch.zeros_like(embeds)
        for mask, rows in zip(visual_masks, levels, strict=True):
            add[mask] = rows.to(embeds.dtype)
        layer_adds.append(add)
    rope_positions = None
    if media.has_vision:
        rope_positions, _ = thinker.get_rope_index(
            ids, media.image_grid_thw, media.video_grid_thw, torch.ones_like(ids), False,
            media.audio_lengths, media.seconds_per_grid(config.vision_config.temporal_patch_size),
        )  # [3, 1, P]
    return Prefill(embeds, rope_positions, tuple(layer_adds))


def _scatter(embeds: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, name: str) -> torch.Tensor:
    """embeds [1, P, D] with rows [n, D] at the n positions of mask [1, P] (transformers' masked_scatter)."""
    num_ids = int(mask.sum())
    if num_ids != rows.shape[0]:
        raise ValueError(f"prompt: {num_ids} {name} pad ids for {rows.shape[0]} {name} encoder rows")
    return embeds.masked_scatter(mask[..., None], rows.to(embeds.dtype))
