"""An explicit thinker decode loop over Qwen3-Omni's thinker on packed weights (`PackedDecoder`).

Each request has its own KV slot: the prefill runs per request (no padding), then one forward per
step over the requests still writing. Every forward's rows of the layer-0 input embeddings and of
the hidden state at `accept_hidden_layer` are handed out with the token, which is what the talker
needs. As in `generate`, there is no forward after a request's last token, so a request with P
prompt and N output tokens leaves P + N − 1 captured rows.

    run = ThinkerRun(model.thinker, [[256, 262, 10, 72, 257, 10, 256, 263, 10]], accept_hidden_layer=1,
                     eos_token_ids={257}, max_new_tokens=64)
    while not run.is_finished:
        for event in run.step():   # ThinkerEvent(index, token_id, embeds [n, D], hidden [n, D], finish_reason)
            ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.sampling import SamplingParams, sample


@dataclass
class ThinkerEvent:
    """What one thinker forward produced for one request.

    token_id: the token it sampled, or None when the request was already finished.
    embeds, hidden: the rows of that forward ([P, D] at prefill, [1, D] after, [0, D] when finished).
    finish_reason: "stop" or "length" on the step that finished the request, else None."""

    index: int
    token_id: int | None
    embeds: torch.Tensor
    hidden: torch.Tensor
    finish_reason: str | None


class ThinkerRun:
    """A batch of requests decoded in lockstep; finished requests are no longer forwarded.

    thinker: transformers' `Qwen3OmniMoeThinkerForConditionalGeneration`. decoder: the packed weights
    of its text model (`PackedDecoder.from_module(thinker.model.language_model)`), made here when
    None; pass one to share it between runs."""

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
    ):
        batch_size = len(prompts)
        if batch_size == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one non-empty prompt")
        if decoder is not None and not isinstance(decoder, PackedDecoder):
            raise ValueError(f"decoder must be None or a PackedDecoder, got {type(decoder).__name__}")
        num_layers = thinker.config.text_config.num_hidden_layers
        if not 0 <= accept_hidden_layer <= num_layers:
            raise ValueError(f"accept_hidden_layer must be in [0, {num_layers}], got {accept_hidden_layer!r}")
        self.thinker = thinker
        self.decoder = decoder or PackedDecoder.from_module(thinker.model.language_model)
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

    @property
    def is_finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def step(self) -> list[ThinkerEvent]:
        """One forward for every unfinished request (the first step: each request's prefill) → one
        event per request."""
        active = [i for i, reason in enumerate(self.finish_reasons) if reason is None]
        device = self.decoder.device
        embed_tokens = self.thinker.get_input_embeddings()
        rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # i → embeds, hidden, logits
        with torch.no_grad():
            if self._is_prefill:
                for i in active:
                    embeds = embed_tokens(torch.tensor([self.prompts[i]], device=device))  # [1, P, D]
                    hidden, logits = self._forward(embeds, [i])
                    rows[i] = (embeds[0], hidden[0], logits[0])
            elif active:
                ids = torch.tensor([self.output_ids[i][-1] for i in active], device=device)[:, None]  # [R, 1]
                embeds = embed_tokens(ids)  # [R, 1, D]
                hidden, logits = self._forward(embeds, active)
                for r, i in enumerate(active):
                    rows[i] = (embeds[r], hidden[r], logits[r])
        self._is_prefill = False
        events = []
        for i in range(len(self.output_ids)):
            if i not in rows:
                empty = torch.zeros((0, self.decoder.hidden_size), dtype=self.decoder.dtype, device=device)
                events.append(ThinkerEvent(i, None, empty, empty, None))
                continue
            row_embeds, row_hidden, logits = rows[i]
            generator = [self.generators[i]] if self.generators[i] is not None else None
            token_id = int(sample(logits[None].float(), self.sampling[i], generator)[0])
            self.output_ids[i].append(token_id)
            if token_id in self.eos_token_ids:
                self.finish_reasons[i] = "stop"
            elif len(self.output_ids[i]) >= self.max_new_tokens:
                self.finish_reasons[i] = "length"
            events.append(ThinkerEvent(i, token_id, row_embeds, row_hidden, self.finish_reasons[i]))
        return events

    def _forward(self, embeds: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [R, T, D] → hidden at accept_hidden_layer [R, T, D] and last-position logits [R, V]."""
        out = decoder_forward(self.decoder, self.kv, embeds, slots, capture_layer=self.accept_hidden_layer)
        logits = torch.nn.functional.linear(out.last_hidden, self.thinker.lm_head.weight)  # [R, V]
        return out.captured, logits
