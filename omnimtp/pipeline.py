"""End-to-end Qwen3-Omni speech: thinker → talker (+ code predictor) → streamed code2wav.

`stream` runs one loop: each iteration runs one thinker step for the requests still writing, hands
their new rows to the talker through `ThinkerToTalkerStream` (so the talker starts as soon as a
request's chunk 0 exists), runs one talker step for every request whose next text row is ready, and
decodes audio in chunks (2 frames first, then 25) with `StreamingCode2Wav`. `generate` streams
nothing, so it works as transformers does: the thinker runs to the end first, each request's talker
inputs are built from all its rows at once (one text projection over the reply, bit-identical to
transformers' call instead of one call per streamed row), then the talker loop runs and each request's
frames are decoded in one block when its talker ends. On one CPU thread interleaving saves no work,
and running the stages one after the other keeps each stage's weights in cache.

    pipe = OmniPipeline.tiny()
    out = pipe.generate("Hello")            # OmniOutput(text, text_ids, codes [G, T], audio, sample_rate, ...)
    for event in pipe.stream("Hello"):      # OmniEvent(text delta, audio chunk or None, finish_reason)
        ...
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from omnimtp.codec.streaming import StreamingCode2Wav
from omnimtp.handoff import ThinkerToTalkerStream, num_kept_rows
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.sampling import SamplingParams, make_generators, request_seeds
from omnimtp.talker.code_predictor import CodePredictorRunner
from omnimtp.talker.loop import TalkerBatch, TalkerRequest
from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder, lookup_speaker, trimmed_thinker_rows
from omnimtp.thinker import ThinkerRun

SAMPLE_RATE = 24_000
FIRST_CHUNK_FRAMES = 2
CHUNK_FRAMES = 25


@dataclass
class OmniOutput:
    """One request's result. codes: [G, T] long; audio: float32 mono at `sample_rate`.
    finish_reason: "length" when the thinker or the talker hit its cap, else "stop"."""

    text: str
    text_ids: list[int]
    codes: torch.Tensor
    audio: np.ndarray
    sample_rate: int
    finish_reason: str
    thinker_finish_reason: str
    talker_finish_reason: str | None


@dataclass
class OmniEvent:
    """A streamed piece of one request: a text delta (possibly ""), an audio chunk or None; the last
    event of a request has `finish_reason` and the complete `output`."""

    index: int
    text: str = ""
    audio: np.ndarray | None = None
    finish_reason: str | None = None
    output: OmniOutput | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    handoff: ThinkerToTalkerStream
    thinker_sampling: SamplingParams | None
    talker_sampling: SamplingParams | None
    talker_generator: torch.Generator | None
    text: str = ""
    output_ids: list[int] = field(default_factory=list)  # the thinker's tokens, stop token included
    frames: list[torch.Tensor] = field(default_factory=list)  # [G] each
    pending_frames: list[torch.Tensor] = field(default_factory=list)  # not decoded yet
    audio: list[np.ndarray] = field(default_factory=list)
    thinker_finish_reason: str | None = None
    talker_finish_reason: str | None = None
    is_talker_done: bool = False
    is_reported: bool = False
    codec_stream: object = None

    @property
    def is_done(self) -> bool:
        return self.thinker_finish_reason is not None and self.is_talker_done and not self.pending_frames


class OmniPipeline:
    """Qwen3-Omni text → text + speech. See the module docstring."""

    def __init__(
        self, model, tokenizer=None, *, max_batch_size: int = 8, max_new_tokens: int = 256, max_frames: int = 4096,
        compile_predictor: bool | str = False,
    ):
        """compile_predictor: `CodePredictorRunner`'s compile mode. False: eager; "step" (or True): each
        predictor step is one compiled graph (tens of seconds per batch size on a CPU); "frame": the
        whole frame is one graph (a minute or more per batch size the first time, seconds once
        inductor's disk cache has it), the fastest. Worth it for a long-lived pipeline, not for a
        one-shot command."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.default_max_new_tokens = max_new_tokens
        self.default_max_frames = max_frames
        config = model.config
        self.eos_token_ids = {config.im_end_token_id}
        self.accept_hidden_layer = config.talker_config.accept_hidden_layer
        self.max_positions = config.thinker_config.text_config.max_position_embeddings
        self.predictor = CodePredictorRunner(model.talker.code_predictor, max_batch_size, compile=compile_predictor)
        # Packed once; the thinker and talker runs of every call share them.
        self.thinker_decoder = PackedDecoder.from_module(model.thinker.model.language_model)
        self.talker_decoder = PackedDecoder.from_module(model.talker.model)
        self.codec = StreamingCode2Wav(model.code2wav)
        speakers = config.talker_config.speaker_id
        self.default_speaker = "ethan" if "ethan" in {s.lower() for s in speakers} else sorted(speakers)[0]

    @classmethod
    def tiny(cls, seed: int = 0) -> "OmniPipeline":
        """The embedded default: a seeded tiny Qwen3-Omni (random weights: its speech is noise-like)
        with the byte-level tokenizer; short caps keep a run to a few seconds."""
        from omnimtp.models.tiny import tiny_qwen3_omni
        from omnimtp.tokenizer import byte_tokenizer

        return cls(tiny_qwen3_omni(seed), byte_tokenizer(), max_new_tokens=32, max_frames=100)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, **kwargs) -> "OmniPipeline":
        """A Qwen3-Omni checkpoint directory (config.json with model_type "qwen3_omni_moe")."""
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

        path = os.fspath(path)
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"path: {path!r} is not a checkpoint directory (no config.json)")
        with open(config_path) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "qwen3_omni_moe":
            raise ValueError(f"path: {path!r} holds a {model_type!r} model, not a Qwen3-Omni (qwen3_omni_moe) checkpoint")
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype)
        if device is not None:
            model = model.to(device)
        has_tokenizer = any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
        return cls(model, tokenizer, **kwargs)

    def save_pretrained(self, path) -> None:
        self.model.save_pretrained(path)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)

    # --- public entry points -----------------------------------------------------------------

    def generate(self, prompt=None, **kwargs) -> OmniOutput | list[OmniOutput]:
        """Text + speech for one prompt (→ OmniOutput) or a list of prompts (→ list). Arguments as `stream`."""
        outputs: dict[int, OmniOutput] = {}
        is_batch = _is_batch(prompt, kwargs.get("input_ids"))
        for event in self._events(prompt, is_audio_streamed=False, **kwargs):
            if event.output is not None:
                outputs[event.index] = event.output
        ordered = [outputs[i] for i in sorted(outputs)]
        return ordered if is_batch else ordered[0]

    def stream(
        self,
        prompt=None,
        *,
        input_ids=None,
        speaker: str | None = None,
        thinker_sampling: SamplingParams | None = None,
        talker_sampling: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        max_frames: int | None = None,
        seed: int | list[int | None] | None = None,
    ) -> Iterator[OmniEvent]:
        """Events as they are ready (see `OmniEvent`). prompt: a string, chat messages, or a list of
        either; or input_ids: token ids (a list, or a list of lists). None sampling = greedy (the talker's
        greedy keeps transformers' repetition penalty 1.05). seed: one per request (an int seeds request
        i with seed + i); a request's output depends only on its own inputs and seed."""
        yield from self._events(
            prompt, input_ids=input_ids, speaker=speaker, thinker_sampling=thinker_sampling,
            talker_sampling=talker_sampling, max_new_tokens=max_new_tokens, max_frames=max_frames, seed=seed,
            is_audio_streamed=True,
        )

    def _events(
        self, prompt, *, input_ids=None, speaker=None, thinker_sampling=None, talker_sampling=None,
        max_new_tokens=None, max_frames=None, seed=None, is_audio_streamed: bool,
    ) -> Iterator[OmniEvent]:
        """`stream`'s events. is_audio_streamed=False (for `generate`) decodes each request's audio in one
        block once its talker ends, which is the one-shot decode that the streamed chunks join into."""
        prompts = self._prompt_ids(prompt, input_ids)
        max_new_tokens = self.default_max_new_tokens if max_new_tokens is None else max_new_tokens
        max_frames = self.default_max_frames if max_frames is None else max_frames
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
            raise ValueError(f"max_frames must be an integer >= 1, got {max_frames!r}")
        for name, value in (("thinker_sampling", thinker_sampling), ("talker_sampling", talker_sampling)):
            if value is not None and not isinstance(value, SamplingParams):
                raise ValueError(f"{name} must be None or a SamplingParams, got {type(value).__name__}")
        for i, ids in enumerate(prompts):
            if len(ids) + max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt: request {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                    f"the thinker's {self.max_positions} positions"
                )
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"prompt: {len(prompts)} requests, more than max_batch_size={self.max_batch_size}")
        speaker = self.default_speaker if speaker is None else speaker
        lookup_speaker(self.model.config.talker_config.speaker_id, speaker)
        seeds = _request_seeds(seed, len(prompts))
        requests = [
            _Request(
                prompt_ids=ids,
                handoff=ThinkerToTalkerStream(Qwen3TalkerInputBuilder(self.model, ids, speaker)),
                thinker_sampling=thinker_sampling,
                talker_sampling=talker_sampling,
                talker_generator=None if s is None else make_generators([request_seeds(s)[1]])[0],
                codec_stream=self.codec.new_stream(),
            )
            for ids, s in zip(prompts, seeds)
        ]
        thinker_generators = [None if s is None else make_generators([request_seeds(s)[0]])[0] for s in seeds]
        thinker = ThinkerRun(
            self.model.thinker, prompts, accept_hidden_layer=self.accept_hidden_layer,
            eos_token_ids=self.eos_token_ids, max_new_tokens=max_new_tokens,
            sampling=[thinker_sampling] * len(prompts), generators=thinker_generators, decoder=self.thinker_decoder,
        )
        talker = TalkerBatch(self.model.talker, self.max_batch_size, predictor=self.predictor, decoder=self.talker_decoder)
        yield from self._run(requests, thinker, talker, max_frames, is_audio_streamed)

    # --- the loop --------------------------------------------------------------------------

    def _run(self, requests: list[_Request], thinker: ThinkerRun, talker: TalkerBatch, max_frames: int, is_audio_streamed: bool):
        if not is_audio_streamed:
            yield from self._thinker_first(requests, thinker, talker, max_frames)
        while not all(r.is_reported for r in requests):
            events = []
            if not thinker.is_finished:
                events += self._thinker_step(requests, thinker, talker, max_frames)
            for frame in talker.step():
                request = requests[frame.request_id]
                if frame.codes is not None:
                    request.frames.append(frame.codes)
                    request.pending_frames.append(frame.codes)
                if frame.finish_reason is not None:
                    request.talker_finish_reason = frame.finish_reason
                    request.is_talker_done = True
                    talker.retire([frame.request_id])
            events += self._decode_audio(requests, is_audio_streamed)
            events += [self._final_event(i, r) for i, r in enumerate(requests) if r.is_done and not r.is_reported]
            yield from events

    def _thinker_first(self, requests, thinker, talker, max_frames) -> Iterator[OmniEvent]:
        """`generate`: the whole thinker run, then every request's talker inputs from all its rows in
        one `build` (transformers' single text projection over the reply) and one admission."""
        embeds: list[list[torch.Tensor]] = [[] for _ in requests]  # [k, D] blocks per request
        hidden: list[list[torch.Tensor]] = [[] for _ in requests]
        while not thinker.is_finished:
            events = []
            for event in thinker.step():
                if event.token_id is None:
                    continue
                request = requests[event.index]
                embeds[event.index].append(event.embeds)
                hidden[event.index].append(event.hidden)
                request.output_ids.append(event.token_id)
                request.thinker_finish_reason = event.finish_reason
                events.append(OmniEvent(event.index, text=self._text_delta(request, thinker.output_ids[event.index])))
            yield from events
        admitted = []
        for i, request in enumerate(requests):
            if not self._has_speech(request, request.thinker_finish_reason):
                request.is_talker_done = True
                continue
            builder = request.handoff.builder
            rows = trimmed_thinker_rows(
                builder.thinker_dim, request.prompt_ids, request.output_ids,
                torch.cat(embeds[i]), torch.cat(hidden[i]), request.thinker_finish_reason,
            )
            inputs = builder.build(*rows, projection="reference")
            admitted.append(TalkerRequest(
                i, inputs.prefill_embeds, inputs.trailing_text, inputs.tts_pad_embed, is_text_finished=True,
                sampling=request.talker_sampling, generator=request.talker_generator, max_frames=max_frames,
            ))
        for frame in talker.admit(admitted):  # talkers that ended before their first frame
            requests[frame.request_id].talker_finish_reason = frame.finish_reason
            requests[frame.request_id].is_talker_done = True
            talker.retire([frame.request_id])

    def _thinker_step(self, requests, thinker, talker, max_frames) -> list[OmniEvent]:
        events = []
        for event in thinker.step():
            if event.token_id is None:
                continue
            request = requests[event.index]
            request.output_ids.append(event.token_id)
            chunks = request.handoff.push(event.embeds, event.hidden, [event.token_id])
            if event.finish_reason is not None:
                request.thinker_finish_reason = event.finish_reason
                if self._has_speech(request, event.finish_reason):
                    chunks += request.handoff.finish(event.finish_reason)
                else:
                    request.is_talker_done = True
            events.append(OmniEvent(event.index, text=self._text_delta(request, thinker.output_ids[event.index])))
            for chunk in chunks:
                if chunk.index == 0:
                    self._admit(talker, requests, event.index, chunk, max_frames)
                elif not request.is_talker_done:  # a talker that already ended needs no more text
                    talker.push_text(event.index, chunk.trailing_text, chunk.is_finished)
        return events

    def _admit(self, talker, requests, index, chunk, max_frames) -> None:
        request = requests[index]
        talker_request = TalkerRequest(
            index, chunk.prefill_embeds, chunk.trailing_text, chunk.tts_pad_embed,
            is_text_finished=chunk.is_finished, sampling=request.talker_sampling,
            generator=request.talker_generator, max_frames=max_frames,
        )
        for frame in talker.admit([talker_request]):  # the talker ended before its first frame
            request.talker_finish_reason = frame.finish_reason
            request.is_talker_done = True
            talker.retire([frame.request_id])

    def _has_speech(self, request: _Request, finish_reason: str) -> bool:
        """Whether the trimmed reply keeps the row the talker prefill needs (our thinker, like
        transformers', never forwards the last token: P + N − 1 rows)."""
        num_prompt, num_output = len(request.prompt_ids), len(request.output_ids)
        kept = min(num_kept_rows(num_prompt, num_output, finish_reason), num_prompt + num_output - 1)
        return kept >= request.handoff.builder.num_prefill_rows

    def _decode_audio(self, requests: list[_Request], is_audio_streamed: bool) -> list[OmniEvent]:
        ready = []
        for i, request in enumerate(requests):
            needed = FIRST_CHUNK_FRAMES if not request.audio else CHUNK_FRAMES
            is_chunk_full = is_audio_streamed and len(request.pending_frames) >= needed
            if request.pending_frames and (is_chunk_full or request.is_talker_done):
                ready.append(i)
        if not ready:
            return []
        blocks = [torch.stack(requests[i].pending_frames, dim=1) for i in ready]  # [G, n] each
        chunks = self.codec.decode([requests[i].codec_stream for i in ready], blocks)
        events = []
        for i, chunk in zip(ready, chunks):
            requests[i].pending_frames = []
            requests[i].audio.append(chunk)
            events.append(OmniEvent(i, audio=chunk))
        return events

    def _final_event(self, index: int, request: _Request) -> OmniEvent:
        request.is_reported = True
        num_groups = self.model.config.talker_config.num_code_groups
        codes = torch.stack(request.frames, dim=1) if request.frames else torch.zeros((num_groups, 0), dtype=torch.long)
        audio = np.concatenate(request.audio) if request.audio else np.zeros(0, dtype=np.float32)
        reasons = (request.thinker_finish_reason, request.talker_finish_reason)
        output = OmniOutput(
            text=request.text, text_ids=list(request.output_ids), codes=codes, audio=audio.astype(np.float32),
            sample_rate=SAMPLE_RATE, finish_reason="length" if "length" in reasons else "stop",
            thinker_finish_reason=request.thinker_finish_reason, talker_finish_reason=request.talker_finish_reason,
        )
        return OmniEvent(index, finish_reason=output.finish_reason, output=output)

    def _text_delta(self, request: _Request, output_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return ""
        delta, request.text = text[len(request.text):], text
        return delta

    # --- inputs -----------------------------------------------------------------------------

    def _prompt_ids(self, prompt, input_ids) -> list[list[int]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of prompt or input_ids")
        if input_ids is not None:
            if isinstance(input_ids, torch.Tensor):
                input_ids = input_ids.tolist()
            rows = input_ids if input_ids and isinstance(input_ids[0], (list, tuple)) else [input_ids]
            prompts = [[int(t) for t in row] for row in rows]
        else:
            if self.tokenizer is None:
                raise ValueError("prompt: this checkpoint has no tokenizer; pass input_ids")
            items = prompt if _is_batch(prompt, None) else [prompt]
            prompts = [self._encode(item) for item in items]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompt: empty prompt")
        return prompts

    def _encode(self, item) -> list[int]:
        if isinstance(item, str):
            if not item.strip():
                raise ValueError("prompt: empty prompt")
            item = [{"role": "user", "content": item}]
        if not isinstance(item, list) or not all(isinstance(m, dict) for m in item) or not item:
            raise ValueError("prompt: expected a string or a non-empty list of chat messages")
        ids = self.tokenizer.apply_chat_template(item, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)


def _is_batch(prompt, input_ids) -> bool:
    if input_ids is not None:
        if isinstance(input_ids, torch.Tensor):
            return input_ids.dim() == 2
        return bool(input_ids) and isinstance(input_ids[0], (list, tuple))
    if isinstance(prompt, list) and prompt:
        return isinstance(prompt[0], (str, list))
    return False


def _request_seeds(seed, num_requests: int) -> list[int | None]:
    if seed is None:
        return [None] * num_requests
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(num_requests)]
    if isinstance(seed, (list, tuple)) and len(seed) == num_requests:
        return list(seed)
    raise ValueError(f"seed must be None, an int or a list of {num_requests} seeds, got {seed!r}")
