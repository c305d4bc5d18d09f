"""An explicit thinker decode loop over transformers' Qwen3-Omni thinker.

One forward per step over a left-padded batch with a `DynamicCache`; every forward's rows of the
layer-0 input embeddings and of the hidden state at `accept_hidden_layer` are handed out with the
token, which is what the talker needs. As in `generate`, there is no forward after a request's last
token, so a request with P prompt and N output tokens leaves P + N − 1 captured rows.

    run = ThinkerRun(model.thinker, [[256, 262, 10, 72, 257, 10, 256, 263, 10]], accept_hidden_layer=1,
                     eos_token_ids={257}, max_new_tokens=64)
    while not run.is_finished:
        for event in run.step():   # ThinkerEvent(index, token_id, embeds [n, D], hidden [n, D], finish_reason)
            ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

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
    """A batch of requests decoded in lockstep; finished rows ride along and are ignored."""

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
        pad_token_id: int = 0,
    ):
        batch_size = len(prompts)
        self.thinker = thinker
        self.accept_hidden_layer = accept_hidden_layer
        self.eos_token_ids = set(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.sampling = list(sampling) if sampling is not None else [None] * batch_size
        self.generators = list(generators) if generators is not None else [None] * batch_size
        self.output_ids: list[list[int]] = [[] for _ in prompts]
        self.finish_reasons: list[str | None] = [None] * batch_size
        self.cache = DynamicCache(config=thinker.config.text_config)
        device = thinker.device
        max_len = max(len(p) for p in prompts)
        self._next_ids = torch.full((batch_size, max_len), pad_token_id, dtype=torch.long, device=device)
        self.attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long, device=device)
        for i, prompt in enumerate(prompts):
            self._next_ids[i, max_len - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            self.attention_mask[i, max_len - len(prompt):] = 1
        self._prompt_lengths = [len(p) for p in prompts]
        self._is_prefill = True

    @property
    def is_finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def step(self) -> list[ThinkerEvent]:
        """One forward for the whole batch → one event per request."""
        mask = self.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -self._next_ids.shape[1]:]  # [B, S_new]
        with torch.no_grad():
            out = self.thinker(
                input_ids=self._next_ids, attention_mask=mask, position_ids=positions[None].expand(4, -1, -1),
                cache=self.cache, use_cache=True, output_hidden_states=True,
            )
        embeds = out.hidden_states[0]  # [B, S_new, D]
        hidden = out.hidden_states[self.accept_hidden_layer]  # [B, S_new, D]
        logits = out.logits[:, -1].float()  # [B, V]
        events = []
        next_ids = []
        for i in range(len(self.output_ids)):
            if self.finish_reasons[i] is not None:
                empty = embeds.new_zeros((0, embeds.shape[-1]))
                events.append(ThinkerEvent(i, None, empty, empty, None))
                next_ids.append(self.output_ids[i][-1] if self.output_ids[i] else 0)
                continue
            num_rows = self._prompt_lengths[i] if self._is_prefill else 1
            generator = [self.generators[i]] if self.generators[i] is not None else None
            token_id = int(sample(logits[i : i + 1], self.sampling[i], generator)[0])
            self.output_ids[i].append(token_id)
            if token_id in self.eos_token_ids:
                self.finish_reasons[i] = "stop"
            elif len(self.output_ids[i]) >= self.max_new_tokens:
                self.finish_reasons[i] = "length"
            row_embeds = embeds[i, -num_rows:].clone()  # [n, D]
            row_hidden = hidden[i, -num_rows:].clone()  # [n, D]
            events.append(ThinkerEvent(i, token_id, row_embeds, row_hidden, self.finish_reasons[i]))
            next_ids.append(token_id)
        self._is_prefill = False
        self._next_ids = torch.tensor(next_ids, dtype=torch.long, device=mask.device)[:, None]  # [B, 1]
        self.attention_mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        return events
