"""Thinker → talker handoff: the stop-row trim, the talker prefill, per-step reply rows, streamed chunks.

Row convention. The thinker emits one row per position it forwards: row i is the input embedding (layer 0)
or a hidden layer of the token at position i. Rows 0..P-1 are the prompt, row P + k belongs to generated
token k. A row exists only if its token was forwarded, so the last generated token usually has no row
(transformers never forwards it); an engine that also forwards the stop token, or a batch that keeps
forwarding a finished row, hands over extra rows. `trim_thinker_hidden` makes both cases the same:

    prompt P = 3, output [a, b, <stop>], finish "stop", hidden R = 8 rows:
    drop = 1 (stop, non-empty output); target = P + 3 - 1 = 5 ... rows 5.. (stop row, extras) discarded.

The talker never speaks a stop token, and keeps every row of a request that hit max tokens.

The streamed handoff (`ThinkerToTalkerStream`) yields exactly what the full-payload path builds; see its
docstring for when it can release a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

FINISH_REASONS = ("stop", "length")


def check_rows(name: str, rows: torch.Tensor, dim: int | None = None) -> None:
    """ValueError naming `name` unless rows is a 2-D tensor [rows, D] (with D == dim when given)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"{name}: expected a 2-D tensor [rows, D], got {shape}")
    if dim is not None and rows.shape[1] != dim:
        raise ValueError(f"{name}: expected D = {dim}, got {rows.shape[1]}")


def check_row(name: str, row: torch.Tensor, dim: int) -> None:
    """ValueError naming `name` unless row is a 1-D tensor [dim]."""
    if not isinstance(row, torch.Tensor) or row.dim() != 1:
        shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
        raise ValueError(f"{name}: expected a 1-D tensor [D], got {shape}")
    if row.shape[0] != dim:
        raise ValueError(f"{name}: expected D = {dim}, got {row.shape[0]}")


def _check_finish_reason(finish_reason: str) -> None:
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason: expected one of {FINISH_REASONS}, got {finish_reason!r}")


def num_kept_rows(num_prompt_tokens: int, num_output_tokens: int, finish_reason: str) -> int:
    """How many thinker rows the talker may see: P + len(output) − 1 for a stop with output, else P + len(output)."""
    _check_finish_reason(finish_reason)
    drop = 1 if finish_reason == "stop" and num_output_tokens > 0 else 0
    return num_prompt_tokens + num_output_tokens - drop


def reply_has_speech(num_prompt_tokens: int, num_output_tokens: int, finish_reason: str, num_prefill_rows: int) -> bool:
    """Whether a finished reply keeps the rows a talker prefill of `num_prefill_rows` needs after the
    stop-row trim. A thinker never forwards its last token, so at most P + N − 1 rows exist."""
    kept = min(num_kept_rows(num_prompt_tokens, num_output_tokens, finish_reason),
               num_prompt_tokens + num_output_tokens - 1)
    return kept >= num_prefill_rows


def trim_thinker_hidden(
    hidden: torch.Tensor,  # [R, D]
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    finish_reason: str,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Split the thinker rows into `(prefill [P, D], decode [n, D], output_ids without the stop id)`.

    Rows beyond `P + len(output_ids) - drop` are discarded; fewer rows give a shorter decode part
    (n < len(new output_ids)); R < P raises. Nothing is mutated; the returned list is new."""
    check_rows("hidden", hidden)
    num_prompt = len(prompt_ids)
    if hidden.shape[0] < num_prompt:
        raise ValueError(f"hidden: {hidden.shape[0]} rows cannot cover the {num_prompt} prompt tokens (prompt_ids)")
    target = num_kept_rows(num_prompt, len(output_ids), finish_reason)
    rows = hidden[:target]
    kept_output_ids = [int(token) for token in output_ids[: target - num_prompt]]
    return rows[:num_prompt], rows[num_prompt:], kept_output_ids


def build_talker_prefill(
    prompt_embeds: torch.Tensor,  # [P, D]
    first_reply: torch.Tensor,  # [D]
    spk_embed: torch.Tensor,  # [D]
    codec_pad_embed: torch.Tensor,  # [D]
    codec_bos_embed: torch.Tensor,  # [D]
    mask_id: int,
    pad_id: int,
    start_id: int,
) -> tuple[list[int], torch.Tensor]:
    """Qwen2.5-Omni talker prefill: `(ids, embeds [P+2, D])`.

    ids = [mask_id]*P + [pad_id, start_id]; embeds = prompt rows, spk + codec_pad, first_reply + codec_bos."""
    check_rows("prompt_embeds", prompt_embeds)
    dim = prompt_embeds.shape[1]
    for name, row in (
        ("first_reply", first_reply), ("spk_embed", spk_embed),
        ("codec_pad_embed", codec_pad_embed), ("codec_bos_embed", codec_bos_embed),
    ):
        check_row(name, row, dim)
    ids = [mask_id] * prompt_embeds.shape[0] + [pad_id, start_id]
    speaker_row = (spk_embed + codec_pad_embed).unsqueeze(0)  # [1, D]
    start_row = (first_reply + codec_bos_embed).unsqueeze(0)  # [1, D]
    return ids, torch.cat([prompt_embeds, speaker_row, start_row], dim=0)


def talker_decode_input(
    reply_queue: torch.Tensor,  # [K, D]
    last_codec_embed: torch.Tensor,  # [D]
    fallback: torch.Tensor,  # [D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One talker decode input: `(head row of the queue + last_codec_embed [D], remaining queue [K-1, D])`.

    An empty queue uses `fallback` and comes back unchanged as the `[0, D]` queue (never None)."""
    check_rows("reply_queue", reply_queue)
    dim = reply_queue.shape[1]
    check_row("last_codec_embed", last_codec_embed, dim)
    check_row("fallback", fallback, dim)
    if reply_queue.shape[0] == 0:
        return fallback + last_codec_embed, reply_queue
    return reply_queue[0] + last_codec_embed, reply_queue[1:]


@dataclass(frozen=True)
class TalkerInputs:
    """Everything the talker needs for one request (no batch dim, no padding).

    prefill_embeds [L, D]: the talker prefill. prefill_ids [L]: the ids the reference passes alongside
    (`talker_input_ids` for Qwen3-Omni, `input_ids` for Qwen2.5-Omni). trailing_text [T, D]: the text
    row added to decode step k (k = 0..T-1). tts_pad_embed [D]: the text row once trailing_text runs out."""

    prefill_embeds: torch.Tensor
    prefill_ids: torch.Tensor
    trailing_text: torch.Tensor
    tts_pad_embed: torch.Tensor

    def __post_init__(self):
        check_rows("prefill_embeds", self.prefill_embeds)
        dim = self.prefill_embeds.shape[1]
        ids = self.prefill_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.long:
            raise ValueError("prefill_ids: expected a 1-D LongTensor")
        if ids.shape[0] != self.prefill_embeds.shape[0]:
            raise ValueError(f"prefill_ids: {ids.shape[0]} ids for {self.prefill_embeds.shape[0]} prefill rows")
        check_rows("trailing_text", self.trailing_text, dim)
        check_row("tts_pad_embed", self.tts_pad_embed, dim)


@dataclass(frozen=True)
class TalkerChunk:
    """One streamed piece of `TalkerInputs`.

    Chunk 0 carries prefill_embeds / prefill_ids / tts_pad_embed (None in later chunks); every chunk
    carries the trailing text rows released with it ([k, D], k may be 0). The last chunk has
    is_finished=True and the finish reason."""

    index: int
    trailing_text: torch.Tensor  # [k, D]
    is_finished: bool = False
    finish_reason: str | None = None
    prefill_embeds: torch.Tensor | None = None  # [L, D], chunk 0 only
    prefill_ids: torch.Tensor | None = None  # [L], chunk 0 only
    tts_pad_embed: torch.Tensor | None = None  # [D], chunk 0 only


def assemble_talker_chunks(chunks: Sequence[TalkerChunk]) -> TalkerInputs:
    """Join a finished stream's chunks back into one `TalkerInputs`."""
    if not chunks or chunks[0].index != 0 or chunks[0].prefill_embeds is None:
        raise ValueError("chunks: must start with chunk 0, which carries the prefill")
    if not chunks[-1].is_finished:
        raise ValueError("chunks: the stream is not finished")
    for position, chunk in enumerate(chunks):
        if chunk.index != position:
            raise ValueError(f"chunks: expected chunk {position}, got chunk {chunk.index}")
    first = chunks[0]
    return TalkerInputs(
        prefill_embeds=first.prefill_embeds,
        prefill_ids=first.prefill_ids,
        trailing_text=torch.cat([chunk.trailing_text for chunk in chunks], dim=0),
        tts_pad_embed=first.tts_pad_embed,
    )


class TalkerInputBuilder(Protocol):
    """A model's talker-input construction, split so it can run on rows as they arrive.

    Thinker rows 0..num_prefill_rows-1 make the talker prefill; every later kept row makes one trailing
    text row, computed row by row (a row's result never depends on the other rows); `end_rows` follow the
    last kept row; `tts_pad_embed` is the fallback once the trailing rows run out; `prefill_positions`
    are the prefill's M-RoPE ids (a prompt with images or videos), None for 1-D positions."""

    num_prompt_rows: int
    num_prefill_rows: int
    end_rows: torch.Tensor  # [E, D_talker]
    tts_pad_embed: torch.Tensor  # [D_talker]
    prefill_positions: torch.Tensor | None  # [3, L]

    def build_prefill(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def build_trailing(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor: ...


def check_prefill_rows(num_rows: int, num_prefill_rows: int) -> None:
    """The talker prefill needs the first reply row; a reply trimmed to nothing has nothing to speak."""
    if num_rows < num_prefill_rows:
        raise ValueError(
            f"output_ids: the talker prefill needs {num_prefill_rows} thinker rows, only {num_rows} remain after "
            "the stop-row trim (the reply has no row to speak)"
        )


def talker_inputs_from_rows(builder: TalkerInputBuilder, embeds: torch.Tensor, hidden: torch.Tensor) -> TalkerInputs:
    """The full-payload path on already-trimmed rows: prefill, then one trailing row per later row, then end rows."""
    split = builder.num_prefill_rows
    check_prefill_rows(embeds.shape[0], split)
    prefill_embeds, prefill_ids = builder.build_prefill(embeds[:split], hidden[:split])
    trailing = builder.build_trailing(embeds[split:], hidden[split:])  # [n, D_talker]
    return TalkerInputs(
        prefill_embeds=prefill_embeds,
        prefill_ids=prefill_ids,
        trailing_text=torch.cat([trailing, builder.end_rows], dim=0),
        tts_pad_embed=builder.tts_pad_embed,
    )


class ThinkerToTalkerStream:
    """Streamed thinker → talker handoff for one request (vllm-omni's async-chunk mode).

    Feed it what the thinker produces, in order: `push(embeds, hidden, token_ids)` with any number of
    new rows (the prompt rows at prefill, then one row per step) and the token ids sampled so far in this
    call; then `finish(finish_reason)`. Each call returns the chunks it released: chunk 0 (the whole talker
    prefill) once the rows the prefill needs are released, then the trailing rows, one per thinker step,
    then a last chunk with is_finished, the end rows (Qwen3: tts_eos) and the finish reason.

    When a row can be released. The full path keeps rows < P + N − drop (`trim_thinker_hidden`), and
    N, drop are known only at finish. With n tokens sampled so far, N ≥ n and drop ≤ 1, so every row
    < P + n − 1 is kept whatever happens next and is released at once. Row P + n − 1 (the row of the
    newest token) is held: if the request then finishes on "stop" with no further token, that token is
    the stop token and the row is dropped, exactly as the full path drops it. An engine that never
    forwards the stop token (transformers, and any normal decode loop) delivers row P + k together with
    token k + 1, so nothing is ever held and chunk 0 goes out on the step that produces the first
    generated row. Rows past the target (a batch that keeps forwarding a finished request) are discarded.

    The assembled chunks (`assemble_talker_chunks`) equal `talker_inputs_from_rows` on the trimmed rows
    bit for bit, because the builder computes each trailing row independently of the others."""

    def __init__(self, builder: TalkerInputBuilder):
        self.builder = builder
        self._pending_embeds: list[torch.Tensor] = []  # [k, D] blocks received and not yet released
        self._pending_hidden: list[torch.Tensor] = []
        self._num_rows = 0
        self._num_tokens = 0
        self._num_released = 0  # rows handed on (prefill rows count once chunk 0 is out)
        self._num_chunks = 0
        self._dim: int | None = None
        self.output_ids: list[int] = []
        self.is_finished = False

    def push(
        self,
        embeds: torch.Tensor,  # [k, D]
        hidden: torch.Tensor,  # [k, D]
        token_ids: Sequence[int] = (),
    ) -> list[TalkerChunk]:
        if self.is_finished:
            raise ValueError("push: the stream is already finished")
        check_rows("embeds", embeds, self._dim)
        check_rows("hidden", hidden, self._dim)
        if hidden.shape[0] != embeds.shape[0]:
            raise ValueError(f"hidden: {hidden.shape[0]} rows for {embeds.shape[0]} embeds rows")
        self._dim = embeds.shape[1]
        if embeds.shape[0] > 0:
            self._pending_embeds.append(embeds)
            self._pending_hidden.append(hidden)
            self._num_rows += embeds.shape[0]
        self.output_ids.extend(int(token) for token in token_ids)
        self._num_tokens = len(self.output_ids)
        safe = self.builder.num_prompt_rows + max(self._num_tokens - 1, 0)
        return self._release(min(safe, self._num_rows), is_finished=False, finish_reason=None)

    def finish(self, finish_reason: str) -> list[TalkerChunk]:
        if self.is_finished:
            raise ValueError("finish: the stream is already finished")
        target = num_kept_rows(self.builder.num_prompt_rows, self._num_tokens, finish_reason)
        if self._num_rows < self.builder.num_prompt_rows:
            raise ValueError(
                f"hidden: {self._num_rows} rows cannot cover the {self.builder.num_prompt_rows} prompt tokens"
            )
        check_prefill_rows(min(target, self._num_rows), self.builder.num_prefill_rows)
        self.is_finished = True
        return self._release(min(target, self._num_rows), is_finished=True, finish_reason=finish_reason)

    def _take(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows num_released..stop-1 out of the pending blocks (the rest stays pending)."""
        count = stop - self._num_released
        embeds = torch.cat(self._pending_embeds, dim=0)  # [pending, D]
        hidden = torch.cat(self._pending_hidden, dim=0)
        self._pending_embeds = [embeds[count:]]
        self._pending_hidden = [hidden[count:]]
        self._num_released = stop
        return embeds[:count], hidden[:count]

    def _release(self, upto: int, is_finished: bool, finish_reason: str | None) -> list[TalkerChunk]:
        chunks = []
        split = self.builder.num_prefill_rows
        if self._num_chunks == 0 and upto >= split:
            prefill_embeds, prefill_ids = self.builder.build_prefill(*self._take(split))
            chunks.append(self._chunk(self._new_rows(upto), False, None, prefill_embeds, prefill_ids))
        elif self._num_chunks > 0 and upto > self._num_released:
            chunks.append(self._chunk(self._new_rows(upto), False, None))
        if is_finished:
            end_rows = self.builder.end_rows
            if chunks:  # the end rows travel in the same (last) chunk
                last = chunks.pop()
                trailing = torch.cat([last.trailing_text, end_rows], dim=0)
                chunks.append(TalkerChunk(
                    last.index, trailing, True, finish_reason, last.prefill_embeds, last.prefill_ids, last.tts_pad_embed
                ))
            else:
                chunks.append(self._chunk(end_rows, True, finish_reason))
        return chunks

    def _new_rows(self, upto: int) -> torch.Tensor:
        if upto <= self._num_released:
            return self.builder.end_rows[:0]
        return self.builder.build_trailing(*self._take(upto))

    def _chunk(self, trailing, is_finished, finish_reason, prefill_embeds=None, prefill_ids=None) -> TalkerChunk:
        index = self._num_chunks
        self._num_chunks += 1
        tts_pad = self.builder.tts_pad_embed if index == 0 else None
        return TalkerChunk(index, trailing, is_finished, finish_reason, prefill_embeds, prefill_ids, tts_pad)


class SpeechTextStream:
    """Talker inputs of a speech request whose text ids arrive in pieces, as `TalkerChunk`s (`push(ids,
    is_finished)` → the chunks it released, like `ThinkerToTalkerStream`'s).

    inputs: the family's whole-text construction (all of a request's ids → `TalkerInputs`), which must build its
    prefill from the first num_prefill_ids ids alone and one trailing row per later spoken id, each row alone
    (text_rows: ids → those rows [n, D]), then its end rows; closing_ids: the ids a finished text ends with that
    are not spoken (Qwen3-TTS: its template's tail). num_prefill_ids None: a layout whose prefill holds the whole
    text (Qwen3-TTS's non_streaming_mode), so nothing is released before the text is finished.

    Chunk 0 is `inputs(first ids + closing_ids)` (a one-id text: the prefill, and trailing rows that are only the
    end rows, kept for the end) once num_prefill_ids ids are here, or `inputs(all ids)` when the text is finished
    first; then one row per id as it comes; the last chunk ends with the end rows. Joined, the chunks are
    `inputs(all ids)` bit for bit, however the ids were split and whenever they came."""

    def __init__(self, inputs, text_rows, num_prefill_ids: int | None, closing_ids: Sequence[int] = ()):
        self.inputs = inputs
        self.text_rows = text_rows
        self.num_prefill_ids = num_prefill_ids
        self.closing_ids = [int(i) for i in closing_ids]
        self.ids: list[int] = []
        self.is_finished = False
        self._num_released = 0  # ids in the prefill or handed out as rows
        self._end_rows: torch.Tensor | None = None
        self._num_chunks = 0

    def push(self, ids: Sequence[int], is_finished: bool = False) -> list[TalkerChunk]:
        if self.is_finished:
            raise ValueError("push: the text is already finished")
        self.ids.extend(int(i) for i in ids)
        self.is_finished = bool(is_finished)
        if self._num_chunks == 0:
            if self.is_finished:
                whole = self.inputs(self.ids)
                return [self._chunk(whole.trailing_text, whole)]
            if self.num_prefill_ids is None or len(self.ids) < self.num_prefill_ids:
                return []
            first = self.inputs(self.ids[: self.num_prefill_ids] + self.closing_ids)
            self._end_rows = first.trailing_text
            self._num_released = self.num_prefill_ids
            return [self._chunk(self._new_rows(), first)]
        rows = self._new_rows()
        if not self.is_finished and rows.shape[0] == 0:
            return []
        return [self._chunk(rows)]

    def _new_rows(self) -> torch.Tensor:
        """The rows of the spoken ids not handed out yet, and the end rows once the text is finished."""
        spoken = len(self.ids) - (len(self.closing_ids) if self.is_finished else 0)
        new = self.ids[self._num_released : spoken]
        self._num_released = max(spoken, self._num_released)
        rows = self.text_rows(new) if new else self._end_rows[:0]
        return torch.cat([rows, self._end_rows]) if self.is_finished else rows

    def _chunk(self, trailing: torch.Tensor, first: TalkerInputs | None = None) -> TalkerChunk:
        index = self._num_chunks
        self._num_chunks += 1
        if first is None:
            return TalkerChunk(index, trailing, self.is_finished)
        return TalkerChunk(index, trailing, self.is_finished, None, first.prefill_embeds, first.prefill_ids,
                           first.tts_pad_embed)
