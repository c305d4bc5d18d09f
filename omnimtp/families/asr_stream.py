"""Streaming recognition with Qwen3-ASR, as the reference's streaming mode does it (`qwen_asr`'s
`init_streaming_state` / `streaming_transcribe` / `finish_streaming_transcribe`, `cli/demo_streaming.py`).

Audio arrives in pieces of any length. Each time `chunk_seconds` of it have gathered, the model transcribes *all*
the audio so far again, its reply continuing a prefix: the previous reply with its last `unfixed_tokens` tokens
rolled back (fewer kept while the cut would split a character), so the words near the edge of the audio, the
unstable ones, are written again with more audio behind them, and the words before them are kept. For the first
`unfixed_chunks` chunks there is no prefix. `finish()` transcribes the tail shorter than a chunk the same way.

`StreamingRecognition` is the state alone: it says what to transcribe next (`next_step`) and takes the reply
(`accept`); a driver runs the steps on the engine (`OmniPipeline.stream_recognition`, or a server session).

    stream = StreamingRecognition(family, language="en")
    stream.feed(samples)
    while (step := stream.next_step()) is not None:
        partial = stream.accept(step, reply_text)      # PartialTranscript(text, language, ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnimtp.media import MediaInputs


@dataclass(frozen=True)
class RecognitionStep:
    """One transcription of the audio so far: the prompt ids (the ASR prompt of all the audio, then the kept
    prefix's ids), its features, the prefix as text, and whether it is the last one (`finish`)."""

    prompt_ids: list[int]
    media: MediaInputs
    prefix: str
    num_samples: int
    is_final: bool


@dataclass(frozen=True)
class PartialTranscript:
    """The transcript after a step: text (the whole text so far, `parse_transcript`'s), the language (forced or
    heard; None when unknown), the audio it covers (seconds) and whether it is the final one."""

    text: str
    language: str | None
    audio_seconds: float
    is_final: bool


class StreamingRecognition:
    """The streaming state of one audio stream (see the module docstring). family: a `Qwen3ASRFamily`;
    language: forced (an ISO code or a name) or None (the model names it); prompt: the context; chunk_seconds: the
    audio gathered between transcriptions (the reference's 2.0); unfixed_chunks: the first chunks transcribed
    without a prefix (2); unfixed_tokens: the reply tokens rolled back into each next transcription (5).
    ValueError naming the argument."""

    def __init__(self, family, language: str | None = None, prompt: str | None = None, *,
                 chunk_seconds: float = 2.0, unfixed_chunks: int = 2, unfixed_tokens: int = 5):
        if isinstance(chunk_seconds, bool) or not isinstance(chunk_seconds, (int, float)) or not chunk_seconds > 0:
            raise ValueError(f"chunk_seconds must be a number > 0, got {chunk_seconds!r}")
        for name, value in (("unfixed_chunks", unfixed_chunks), ("unfixed_tokens", unfixed_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        family.transcription_messages(None, language, prompt)  # ValueError naming language or prompt
        self.family = family
        self.language = language
        self.prompt = prompt
        self.sample_rate = family.processor.feature_extractor.sampling_rate
        self.chunk_samples = max(1, int(round(float(chunk_seconds) * self.sample_rate)))
        self.unfixed_chunks = unfixed_chunks
        self.unfixed_tokens = unfixed_tokens
        self.num_chunks = 0  # transcriptions done
        self._buffer = np.zeros(0, dtype=np.float32)  # samples not yet in a chunk
        self._audio = np.zeros(0, dtype=np.float32)  # every sample transcribed so far
        self._reply = ""  # the last transcription's prefix + reply (what the next prefix is cut from)
        self.is_finished = False

    @property
    def reply(self) -> str:
        """The last transcription's prefix and reply ("" before the first): the raw text of the transcript so far."""
        return self._reply

    def feed(self, samples: np.ndarray) -> None:
        """More audio: 1-D float samples at the model's rate (16 kHz), or int16 PCM."""
        if self.is_finished:
            raise ValueError("samples: the stream is finished")
        samples = np.asarray(samples)
        if samples.ndim != 1 or not (np.issubdtype(samples.dtype, np.floating) or samples.dtype == np.int16):
            raise ValueError(f"samples: expected 1-D float or int16 samples, got {samples.dtype} {samples.shape}")
        if samples.dtype == np.int16:
            samples = samples.astype(np.float32) / 32768.0
        if not np.isfinite(samples).all():
            raise ValueError("samples: not finite")
        self._buffer = np.concatenate([self._buffer, samples.astype(np.float32)])

    def next_step(self) -> RecognitionStep | None:
        """The next transcription when a whole chunk has gathered (its samples join the audio), else None."""
        if self.is_finished or self._buffer.shape[0] < self.chunk_samples:
            return None
        chunk, self._buffer = self._buffer[: self.chunk_samples], self._buffer[self.chunk_samples:]
        return self._step(chunk, self._prefix(exact=True), is_final=False)

    def finish(self) -> RecognitionStep | None:
        """The last transcription, of the tail shorter than a chunk; None when there is none (no audio left)."""
        self.is_finished = True
        if self._buffer.shape[0] == 0:
            return None
        tail, self._buffer = self._buffer, np.zeros(0, dtype=np.float32)
        return self._step(tail, self._prefix(exact=False), is_final=True)

    def accept(self, step: RecognitionStep, reply: str) -> PartialTranscript:
        """The model's reply to `step` (its text, special tokens skipped) → the transcript so far."""
        self._reply = step.prefix + reply
        self.num_chunks += 1
        language, text = self.family.parse_transcript(self._reply, self.language)
        return PartialTranscript(text, language, step.num_samples / self.sample_rate, step.is_final)

    def _step(self, samples: np.ndarray, prefix: str, is_final: bool) -> RecognitionStep:
        self._audio = np.concatenate([self._audio, samples])
        ids, media = self.family.transcription_inputs(self._audio, self.language, self.prompt)
        if prefix:
            ids = ids + self.family.tokenizer.encode(prefix, add_special_tokens=False)
        return RecognitionStep(ids, media, prefix, self._audio.shape[0], is_final)

    def _prefix(self, exact: bool) -> str:
        """The last reply with its last `unfixed_tokens` tokens rolled back ("" for the first unfixed_chunks).
        exact: while the cut splits a character (a U+FFFD in the decoded prefix) one more token goes (a chunk's
        rule); else at least one token stays and the cut is taken as it is (the reference's tail rule)."""
        if self.num_chunks < self.unfixed_chunks:
            return ""
        tokenizer = self.family.tokenizer
        ids = tokenizer.encode(self._reply, add_special_tokens=False)
        if not exact:
            return tokenizer.decode(ids[: max(1, len(ids) - self.unfixed_tokens)])
        cut = self.unfixed_tokens
        while True:
            end = max(0, len(ids) - cut)
            prefix = tokenizer.decode(ids[:end]) if end > 0 else ""
            if "\ufffd" not in prefix or end == 0:
                return prefix
            cut += 1
