"""Qwen3-ForcedAligner: when each word (each character of Chinese) of a known transcript is spoken.

The aligner is Qwen3-ASR's thinker (`omnimtp.models.qwen3_asr`) whose head classifies a position into one of
`classify_num` time bins of `timestamp_segment_time` ms. It is not autoregressive: one forward over

    <|audio_start|><|audio_pad|>×A<|audio_end|>word₁<timestamp><timestamp>word₂<timestamp><timestamp>…

reads the bins at the `<timestamp>` positions, two per word (start, end). The reference (`qwen_asr`'s
`Qwen3ForcedAligner.align` and `Qwen3ForceAlignProcessor`) splits the transcript into words
(`omnimtp.families.aligner_words`: at spaces with each CJK ideograph a slot of its own, Japanese and Korean by
their dictionary tokenizers), and repairs bins that run backwards: the
longest non-decreasing run stays, a gap of one or two takes the nearer neighbour, a longer gap is spread
evenly between its neighbours. The forward runs on the packed (optionally quantized) decoder, one request at
a time (a lock serializes callers).

    aligner = Qwen3ForcedAligner.tiny()        # or Qwen3ForcedAligner.from_pretrained(".../Qwen3-ForcedAligner-0.6B")
    words = aligner.align(samples, "Hello there.", "English")    # [AlignedWord("Hello", 0.08, 0.4), ...]
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from omnimtp.families.aligner_words import words_of
from omnimtp.families.qwen3_asr import ASRProcessor, asr_language, checkpoint_parts
from omnimtp.media import AUDIO_SAMPLING_RATE, MediaLimits, load_audio
from omnimtp.models.qwen3_asr import TIMESTAMP_TOKEN, Qwen3ASRModel, encoder_thinker
from omnimtp.packed_decoder import PackedDecoder, decoder_forward
from omnimtp.runtime.ops import check_many_row_mode, check_quantize, linear
from omnimtp.thinker import multimodal_prefill


@dataclass(frozen=True)
class AlignedWord:
    """A word (or CJK character) and when it is spoken, in seconds (millisecond steps)."""

    word: str
    start: float
    end: float


def repair_bins(values: list[float]) -> list[int]:
    """Time bins (ms) that run backwards repaired as the reference does: the longest non-decreasing subsequence
    (the first of equal length, earliest predecessors) is kept; a run of one or two others takes its nearer kept
    neighbour (the left one on a tie, the only one at an end), a longer run is spread evenly between its kept
    neighbours (or takes the one it has); each value then truncates to an int.

        >>> repair_bins([80, 160, 0, 320])
        [80, 160, 160, 320]"""
    n = len(values)
    if n == 0:
        return []
    length, parent = [1] * n, [-1] * n
    for i in range(1, n):
        for j in range(i):
            if values[j] <= values[i] and length[j] + 1 > length[i]:
                length[i], parent[i] = length[j] + 1, j
    kept = [False] * n
    index = length.index(max(length))
    while index != -1:
        kept[index], index = True, parent[index]
    result = list(values)
    i = 0
    while i < n:
        if kept[i]:
            i += 1
            continue
        j = i
        while j < n and not kept[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if kept[k]), None)
        right = next((result[k] for k in range(j, n) if kept[k]), None)
        for k in range(i, j):
            if j - i <= 2:
                nearer_left = left is not None and (right is None or k - (i - 1) <= j - k)
                result[k] = left if nearer_left else right
            elif left is not None and right is not None:
                result[k] = left + (right - left) / (j - i + 1) * (k - i + 1)
            else:
                result[k] = left if left is not None else right
        i = j
    return [int(value) for value in result]


class Qwen3ForcedAligner:
    """A Qwen3-ForcedAligner (see the module docstring). model: `Qwen3ASRModel` of an aligner checkpoint;
    tokenizer: its text tokenizer; processor: its `ASRProcessor` (default: a WhisperFeatureExtractor of the
    model's mel bins at 16 kHz); quantize: the decoder's linears and its head (`OmniPipeline`'s modes), the audio
    encoder as the ASR's (`omnimtp.models.qwen3_asr.encoder_thinker`). int8_compute: the audio encoder's linears
    and the one forward's on int8 GEMMs ("w8a8": int8 weights per channel, each row quantized to int8; the head
    int8 too), whatever `quantize` says; ValueError naming int8_compute where that does not run."""

    def __init__(self, model: Qwen3ASRModel, tokenizer, *, processor: ASRProcessor | None = None,
                 quantize: str | None = None, int8_compute: bool = False):
        if not isinstance(model, Qwen3ASRModel) or not model.is_aligner:
            raise ValueError("model: expected a Qwen3-ForcedAligner (a Qwen3ASRModel with classify_num time bins)")
        thinker = model.thinker
        check_quantize(quantize, thinker.device)
        if not isinstance(int8_compute, bool):
            raise ValueError(f"int8_compute must be True or False, got {int8_compute!r}")
        if int8_compute:
            check_many_row_mode("w8a8", thinker.device, "int8_compute")
        self.model = model.eval()
        self.tokenizer = tokenizer
        if processor is None:
            from transformers import WhisperFeatureExtractor

            processor = ASRProcessor(WhisperFeatureExtractor(
                feature_size=thinker.config.audio_config.num_mel_bins, sampling_rate=AUDIO_SAMPLING_RATE,
                return_attention_mask=True), tokenizer)
        self.processor = processor
        self.languages = model.support_languages
        self.timestamp_token_id = model.timestamp_token_id
        self.segment_ms = model.timestamp_segment_time
        self.max_positions = thinker.config.text_config.max_position_embeddings
        # its only forward has many rows: with int8_compute its layers are "w8a8" whatever `quantize` says
        decoder = PackedDecoder.from_module(thinker.model, quantize="w8a8" if int8_compute else quantize)
        if quantize is not None or int8_compute:
            decoder = decoder.with_quantized_lm_head(thinker.lm_head.weight)
        self.decoder = decoder
        self.quantize = quantize
        self.int8_compute = int8_compute
        self.thinker = encoder_thinker(thinker, quantize, int8_compute)
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, **kwargs) -> Qwen3ForcedAligner:
        """An aligner checkpoint in the released layout (config.json, model.safetensors, the tokenizer files,
        preprocessor_config.json), or the built-in tiny one's name ("tiny-aligner")."""
        from omnimtp.checkpoint import TINY_ALIGNER

        path = os.fspath(path)
        if path == TINY_ALIGNER and not os.path.exists(path):
            return cls.tiny(device=device, **kwargs)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"path: {path!r} is not a checkpoint directory (no config.json), nor {TINY_ALIGNER!r}")
        model = Qwen3ASRModel.from_pretrained(path, dtype=dtype)
        if not model.is_aligner:
            raise ValueError(f"path: {path!r} is a Qwen3-ASR model, not a Qwen3-ForcedAligner")
        model, tokenizer, processor = checkpoint_parts(model, path, device)
        return cls(model, tokenizer, processor=processor, **kwargs)._owning_model()

    @classmethod
    def tiny(cls, seed: int = 0, device=None, **kwargs) -> Qwen3ForcedAligner:
        """The seeded tiny aligner (`omnimtp.models.qwen3_asr.tiny_qwen3_asr(aligner=True)`), the ASR byte
        tokenizer."""
        from omnimtp.models.qwen3_asr import asr_byte_tokenizer, tiny_qwen3_asr
        from omnimtp.runtime.device import one_thread, resolve_device

        with one_thread():
            model = tiny_qwen3_asr(seed, aligner=True)
            if device is not None:
                model = model.to(resolve_device(device))
                model.restore_buffers()
            return cls(model, asr_byte_tokenizer(), **kwargs)._owning_model()

    def _owning_model(self) -> Qwen3ForcedAligner:
        """This aligner, for a model it made itself: quantized, the float matrices its quantized copies replace are
        released from the model (`Qwen3ASRModel.release_decoder_linears`, `.release_audio_encoder`)."""
        if self.decoder.quantize is not None:
            self.model.release_decoder_linears()
        if self.thinker is not self.model.thinker:  # it encodes with its bf16 (or w8a8) copy
            self.model.release_audio_encoder()
        return self

    def words(self, text: str, language: str | None) -> list[str]:
        """The transcript's alignment units (`omnimtp.families.aligner_words.words_of`; language None: by the text's
        script). ValueError naming language for one the model does not know, or Japanese or Korean without their
        word splitters installed."""
        return words_of(text, asr_language(language, self.languages))

    def prompt_ids(self, words: list[str], num_rows: int) -> list[int]:
        """The aligner's prompt: the audio's placeholder run, then each word followed by two time slots."""
        slots = TIMESTAMP_TOKEN * 2
        text = f"<|audio_start|>{'<|audio_pad|>' * num_rows}<|audio_end|>" + slots.join(words) + slots
        return self.tokenizer.encode(text, add_special_tokens=False)

    def align(self, audio, text: str, language: str | None, limits: MediaLimits | None = None) -> list[AlignedWord]:
        """When each word of `text` (the transcript of `audio`: a path, a (samples, rate) pair or 16 kHz samples)
        is spoken. language: an ISO code, a language name, or None (words split by the text's script: Japanese
        with kana, Korean with Hangul, else at spaces and CJK characters). ValueError naming audio, text or
        language."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        words = self.words(text, language)
        if not words:
            return []
        samples = load_audio(audio, self.processor.feature_extractor.sampling_rate, limits or MediaLimits(), "audio")
        max_seconds = self.model.thinker.config.classify_num * self.segment_ms / 1000
        if samples.shape[0] > max_seconds * self.processor.feature_extractor.sampling_rate:
            raise ValueError(f"audio: {samples.shape[0] / self.processor.feature_extractor.sampling_rate:.1f} s is "
                             f"longer than the aligner's time bins reach ({max_seconds:g} s)")
        media = self.processor.features(samples)
        n_window = self.model.thinker.config.audio_config.n_window
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

        num_rows = int(_get_feat_extract_output_lengths(media.audio_lengths, n_window)[0])
        ids = self.prompt_ids(words, num_rows)
        if len(ids) > self.max_positions:
            raise ValueError(f"text: {len(ids)} aligner positions with the audio, more than {self.max_positions}")
        with self._lock, torch.no_grad():
            bins = self._bins(ids, media)
        stamps = repair_bins((bins * self.segment_ms).tolist())
        return [AlignedWord(word, round(stamps[2 * i] / 1000, 3), round(stamps[2 * i + 1] / 1000, 3))
                for i, word in enumerate(words)]

    def _bins(self, ids: list[int], media) -> np.ndarray:
        """The time bin at each `<timestamp>` position of the prompt: one forward over it, the head on those rows."""
        prefill = multimodal_prefill(self.thinker, ids, media, self.decoder.device)
        rows = self.timestamp_rows(ids, prefill.embeds)  # [2·words, D]
        if self.decoder.quantized_lm_head is not None:
            logits = linear(rows, None, packed=self.decoder.quantized_lm_head)
        else:
            logits = torch.nn.functional.linear(rows, self.model.thinker.lm_head.weight)
        return logits.argmax(-1).cpu().numpy()

    def timestamp_rows(self, ids: list[int], embeds: torch.Tensor) -> torch.Tensor:
        """The decoder's final rows [2·words, D] at the prompt's `<timestamp>` positions: one forward over its input
        embeddings [1, P, D] (`multimodal_prefill`'s), without a KV cache (nothing reads its keys again), the last
        layer on those positions only."""
        slots = torch.nonzero(torch.tensor(ids, device=self.decoder.device) == self.timestamp_token_id)[:, 0]
        out = decoder_forward(self.decoder, None, embeds.to(self.decoder.dtype), None, all_final=True,
                              output_index=slots[None])
        return out.final[0]
