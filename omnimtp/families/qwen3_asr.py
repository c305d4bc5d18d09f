"""Qwen3-ASR behind the engine's family interface: the ASR prompt, the thinker run, the transcript.

A Qwen3-ASR model hears and writes: it has a thinker (Qwen3-Omni's audio encoder + a dense Qwen3 decoder,
`omnimtp.models.qwen3_asr`) and no talker, so it takes transcription requests only (`has_chat` False; a request
that asks for speech is refused naming `speaker`). Its requests run on the engine like any other: one KV slot
each in a batched `omnimtp.thinker.ThinkerRun` over the packed (optionally quantized) decoder.

The prompt is the released chat template's (`qwen_asr`'s `_build_text_prompt`), one audio per request:

    <|im_start|>system\\n{context}<|im_end|>\\n<|im_start|>user\\n<|audio_start|><|audio_pad|>×A<|audio_end|><|im_end|>\\n
    <|im_start|>assistant\\n[language {Language}<asr_text>]

with A the encoder rows of the audio. Without a language the model writes `language {Language}<asr_text>{text}`
itself (`parse_transcript` splits it, as `qwen_asr.parse_asr_output`); with one, the text alone.

    family = Qwen3ASRFamily.tiny()          # or Qwen3ASRFamily.from_pretrained(".../Qwen3-ASR-0.6B")
    ids, media = family.transcription_inputs(samples, language="en")   # ChatText's: chat_inputs of the messages
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnimtp.families.text import ChatText, TranscriptDeltas
from omnimtp.media import AUDIO_SAMPLING_RATE, MediaInputs, MediaLimits, load_audio
from omnimtp.models.qwen3_asr import (
    ASR_LANGUAGES,
    ASR_TEXT_TOKEN,
    Qwen3ASRModel,
    encoder_thinker,
)
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.runtime.ops import check_many_row_mode, check_quantize
from omnimtp.sampling import SamplingParams
from omnimtp.thinker import PrefixRows, ThinkerRun
from omnimtp.tokenizer import prompt_tokenizer

LANGUAGE_PREFIX = "language "
# ISO-639-1 (and -3 where there is none) codes of the released languages, what OpenAI's `language` takes.
LANGUAGE_CODES = {
    "zh": "Chinese", "en": "English", "yue": "Cantonese", "ar": "Arabic", "de": "German", "fr": "French",
    "es": "Spanish", "pt": "Portuguese", "id": "Indonesian", "it": "Italian", "ko": "Korean", "ru": "Russian",
    "th": "Thai", "vi": "Vietnamese", "ja": "Japanese", "tr": "Turkish", "hi": "Hindi", "ms": "Malay", "nl": "Dutch",
    "sv": "Swedish", "da": "Danish", "fi": "Finnish", "pl": "Polish", "cs": "Czech", "fil": "Filipino",
    "tl": "Filipino", "fa": "Persian", "el": "Greek", "ro": "Romanian", "hu": "Hungarian", "mk": "Macedonian",
}
CODES_BY_LANGUAGE = {name: code for code, name in reversed(list(LANGUAGE_CODES.items()))}


def asr_language(language: str | None, supported=ASR_LANGUAGES) -> str | None:
    """An ISO code ("en") or a language name (any case) → the released name ("English"); None stays None.
    ValueError naming `language` for anything else."""
    if language is None:
        return None
    if not isinstance(language, str) or not language.strip():
        raise ValueError(f"language: expected a language code such as 'en', got {language!r}")
    key = language.strip().lower()
    name = LANGUAGE_CODES.get(key) or next((name for name in supported if name.lower() == key), None)
    if name is None or name not in supported:
        raise ValueError(f"language: {language!r} is not a language of the model; one of "
                         f"{sorted(CODES_BY_LANGUAGE[n] for n in supported if n in CODES_BY_LANGUAGE)}")
    return name


def collapse_repeats(text: str, threshold: int = 20, max_pattern: int = 20) -> str:
    """A reply that loops cut back as the reference cuts it (`qwen_asr`'s `detect_and_fix_repetitions`): a run of
    more than `threshold` equal characters becomes one; then, scanning from the start, the first piece of 1 to
    `max_pattern` characters repeated at least `threshold` times in a row stays once, the rest after its repeats
    is cut the same way.

        >>> collapse_repeats("ab" + "x" * 30 + "cd")
        'abxcd'"""
    kept, start = [], 0
    while start < len(text):
        end = start
        while end < len(text) and text[end] == text[start]:
            end += 1
        kept.append(text[start] if end - start > threshold else text[start:end])
        start = end
    return _collapse_patterns("".join(kept), threshold, max_pattern)


def _collapse_patterns(text: str, threshold: int, max_pattern: int) -> str:
    n = len(text)
    for i in range(max(0, n - 2 * threshold + 1)):
        for k in range(1, max_pattern + 1):
            if i + k * threshold > n:
                break
            pattern = text[i:i + k]
            if all(text[i + r * k:i + (r + 1) * k] == pattern for r in range(1, threshold)):
                end = i + threshold * k
                while end + k <= n and text[end:end + k] == pattern:
                    end += k
                return text[:i] + pattern + _collapse_patterns(text[end:], threshold, max_pattern)
    return text


def parse_transcript(raw: str, language: str | None = None) -> tuple[str | None, str]:
    """The model's raw reply → (language, text), as `qwen_asr.parse_asr_output`: a looping reply is cut
    (`collapse_repeats`); with a forced language the reply is the text; else "language English<asr_text>Hello."
    → ("English", "Hello."), "language None<asr_text>" (no speech) → (None, ""), a reply without the tag is all
    text."""
    text = collapse_repeats(raw.strip())
    if language is not None or ASR_TEXT_TOKEN not in text:
        return language, text
    meta, text = text.split(ASR_TEXT_TOKEN, 1)
    detected = None
    for line in meta.splitlines():
        line = line.strip()
        if line.lower().startswith(LANGUAGE_PREFIX):
            value = line[len(LANGUAGE_PREFIX):].strip()
            detected = None if not value or value.lower() == "none" else value[:1].upper() + value[1:].lower()
            break
    return detected, text.strip()


@dataclass
class ASRProcessor:
    """What the pipeline and server read of an ASR model's processor: its feature extractor (16 kHz log-mel,
    `WhisperFeatureExtractor`) and its tokenizer."""

    feature_extractor: WhisperFeatureExtractor
    tokenizer: object

    def features(self, samples: np.ndarray) -> MediaInputs:
        """16 kHz float samples → input_features [1, mel, T] and feature_attention_mask [1, T], as the reference's
        processor makes them (padded to no chunk, never truncated)."""
        out = self.feature_extractor(samples, sampling_rate=self.feature_extractor.sampling_rate, padding=True,
                                     truncation=False, return_attention_mask=True, return_tensors="pt")
        return MediaInputs(input_features=out["input_features"].float(), feature_attention_mask=out["attention_mask"])

    def save_pretrained(self, path) -> None:
        """preprocessor_config.json (the feature extractor) and the tokenizer's files."""
        self.feature_extractor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def checkpoint_parts(model: Qwen3ASRModel, path: str, device) -> tuple[Qwen3ASRModel, object, ASRProcessor | None]:
    """(model on `device`, tokenizer, processor) of a checkpoint in the released layout whose model is loaded: the
    tokenizer files at `path`, and its `ASRProcessor` where it has preprocessor_config.json (else None: the
    family's default). device None: the model where it is."""
    from transformers import AutoTokenizer

    from omnimtp.runtime.device import resolve_device

    if device is not None:
        model = model.to(resolve_device(device))
        model.restore_buffers()
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = None
    if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        processor = ASRProcessor(WhisperFeatureExtractor.from_pretrained(path), tokenizer)
    return model, tokenizer, processor


class _NoTalker:
    """The talker batch of a model that does not speak: it never holds a row (the engine admits no speech request
    of such a family: `check_speaker` refuses them first)."""

    rows = ()

    def retire(self, request_ids) -> None:
        pass


class _AsrTemplate:
    """Renders the released single-audio ASR prompt (what `PromptTokenizer.rendered` asks a template for)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        context = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        return (f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|><|audio_pad|>"
                "<|audio_end|><|im_end|>\n<|im_start|>assistant\n")


KV_DTYPES = (None, "bfloat16")  # `Qwen3ASRFamily(kv_dtype=...)`


class Qwen3ASRFamily(ChatText):
    """Qwen3-ASR's side of the engine (see the module docstring).

    model: `omnimtp.models.qwen3_asr.Qwen3ASRModel` (an ASR, not an aligner); tokenizer: its text tokenizer;
    processor: its `ASRProcessor` (default: a 128-bin WhisperFeatureExtractor at 16 kHz, the released one, or
    the model's mel bins). quantize: the decoder's linears and its head (`OmniPipeline`'s modes); the audio
    encoder then runs in bf16 where oneDNN runs bf16 (`omnimtp.models.qwen3_asr.encoder_thinker`); stored: a
    quantized checkpoint's layers (`omnimtp.quantized_checkpoint`), with quantize its mode. int8_compute: the
    many-row linears, the audio encoder's and every prompt's forward (`ThinkerRun`'s prefill_decoder), on int8
    GEMMs ("w8a8": int8 weights per channel, each row quantized to int8), the decode steps as `quantize` says;
    ValueError naming int8_compute where oneDNN's int8 GEMM does not run exactly (no AVX512-VNNI) or with
    `stored` (it quantizes the float matrices). kv_dtype: None (the KV cache in the decoder's fp32) or "bfloat16"
    with quantize="w4a8" (each key and value rounded to bf16 as it is written, read back widened by the native
    decode step: half the bytes a step reads from the cache; `PackedDecoder.with_kv_dtype`)."""

    model_type = "qwen3_asr"
    decoder_paths = ("thinker.model",)  # the packed (and quantized) decoder
    has_chat = False
    sample_rate = AUDIO_SAMPLING_RATE
    num_code_groups = 0
    codec_looks_ahead = False
    default_speaker = None
    speaks = False

    def __init__(self, model: Qwen3ASRModel, tokenizer, *, processor: ASRProcessor | None = None,
                 quantize: str | None = None, stored: dict | None = None, int8_compute: bool = False,
                 kv_dtype: str | None = None):
        if not isinstance(model, Qwen3ASRModel) or model.is_aligner:
            raise ValueError("model: expected a Qwen3-ASR model (a Qwen3ASRModel that is not a forced aligner)")
        if tokenizer is None:
            raise ValueError("tokenizer: a Qwen3-ASR model needs its tokenizer (its prompt and its transcripts)")
        thinker = model.thinker
        check_quantize(quantize, thinker.device)
        if not isinstance(int8_compute, bool):
            raise ValueError(f"int8_compute must be True or False, got {int8_compute!r}")
        if int8_compute:
            check_many_row_mode("w8a8", thinker.device, "int8_compute")
            if stored is not None:
                raise ValueError("int8_compute: a quantized checkpoint holds no float matrices to quantize to int8; "
                                 "load the float checkpoint with quantize=")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype is not None and quantize != "w4a8":
            # the w4a8 native step reads the bf16 rows as they are; the op-by-op layers widen the whole cache a step
            raise ValueError(f"kv_dtype={kv_dtype!r}: a bf16 KV cache is part of quantize=\"w4a8\" only, got "
                             f"quantize={quantize!r}")
        self.model = model.eval()
        self.quantize = quantize
        self.int8_compute = int8_compute
        self.kv_dtype = kv_dtype
        self.tokenizer = tokenizer
        if processor is None:
            mel_bins = thinker.config.audio_config.num_mel_bins
            processor = ASRProcessor(WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=AUDIO_SAMPLING_RATE,
                                                             return_attention_mask=True), tokenizer)
        self.processor = processor
        self.languages = model.support_languages
        text_config = thinker.config.text_config
        self.max_positions = text_config.max_position_embeddings
        self.accept_hidden_layer = text_config.num_hidden_layers  # the last layer's rows (no talker reads them)
        self.eos_token_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        if isinstance(endoftext, int) and endoftext != tokenizer.unk_token_id:
            self.eos_token_ids.add(endoftext)
        decoder = PackedDecoder.from_module(thinker.model, quantize=quantize,
                                            stored=(stored or {}).get(self.decoder_paths[0]))
        if quantize is not None:  # its logits from an int8 head too; greedy steps' tokens from its int4 screen
            decoder = decoder.with_quantized_lm_head(thinker.lm_head.weight, screen=True)
        self.thinker_decoder = decoder.with_row_kernel().with_kv_dtype(kv_dtype and getattr(torch, kv_dtype))
        self.prefill_decoder = PackedDecoder.from_module(thinker.model, quantize="w8a8") if int8_compute else None
        # quantized (or int8_compute), the audio encoder a bf16 (or w8a8) copy: the model's own stays float
        self.thinker = encoder_thinker(thinker, quantize, int8_compute)
        self.speech_header_ids = None

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, quantized=None,
                        **kwargs) -> Qwen3ASRFamily:
        """A checkpoint in the released layout: config.json + model.safetensors, the tokenizer files and
        preprocessor_config.json (the feature extractor; the released one without it). quantized: the checkpoint
        at `path` loaded by `omnimtp.quantized_checkpoint.load_quantized_model` when it is a quantized one
        (`OmniPipeline.from_pretrained` does it): its model and stored matrices, in its mode."""
        from omnimtp.runtime.device import resolve_device

        path = os.fspath(path)
        if quantized is not None:
            if device is not None and resolve_device(device).type != "cpu":
                raise ValueError(f"device: {path!r} is a quantized checkpoint; its kernels run on the CPU only")
            if kwargs.get("quantize") not in (None, quantized.mode):
                raise ValueError(f"quantize={kwargs['quantize']!r}: {path!r} holds {quantized.mode!r} weights "
                                 "(quantize with `omnimtp quantize` again from the float checkpoint for another mode)")
            model, device = quantized.model, None
            kwargs.update(quantize=quantized.mode, stored=quantized.stored)
        else:
            model = Qwen3ASRModel.from_pretrained(path, dtype=dtype)
        if model.is_aligner:
            raise ValueError(f"path: {path!r} is a Qwen3-ForcedAligner; serve it with --aligner-model")
        model, tokenizer, processor = checkpoint_parts(model, path, device)
        return cls(model, tokenizer, processor=processor, **kwargs)._owning_model()

    @classmethod
    def tiny(cls, seed: int = 0, device=None, **kwargs) -> Qwen3ASRFamily:
        """The seeded tiny Qwen3-ASR (`omnimtp.models.qwen3_asr.tiny_qwen3_asr`) with the ASR byte tokenizer."""
        from omnimtp.models.qwen3_asr import asr_byte_tokenizer, tiny_qwen3_asr
        from omnimtp.runtime.device import one_thread, resolve_device

        with one_thread():
            model = tiny_qwen3_asr(seed)
            if device is not None:
                model = model.to(resolve_device(device))
                model.restore_buffers()
            return cls(model, asr_byte_tokenizer(), **kwargs)._owning_model()

    def _owning_model(self) -> Qwen3ASRFamily:
        """This family, for a model it made itself: quantized, the float matrices its quantized copies replace are
        released from the model (`Qwen3ASRModel.release_decoder_linears`, and `.release_audio_encoder`: it encodes
        with its bf16 copy), so quantizing saves memory. A model the caller passed is left as it is."""
        if self.quantize is not None:
            self.model.release_decoder_linears()
        if self.thinker is not self.model.thinker:  # it encodes with its bf16 (or w8a8) copy
            self.model.release_audio_encoder()
        return self

    @property
    def device(self) -> torch.device:
        return self.thinker_decoder.device

    # --- requests ---

    def check_speaker(self, speaker) -> None:
        raise ValueError("speaker: a Qwen3-ASR model does not speak; it transcribes (OmniPipeline.transcribe)")

    def transcription_language(self, language: str | None) -> str | None:
        """An ISO code or a language name → the model's name for it (`asr_language`); None stays None."""
        return asr_language(language, self.languages)

    def transcription_messages(self, audio, language: str | None = None, prompt: str | None = None) -> list[dict]:
        """The reference's messages for one audio (`qwen_asr`'s `_build_messages`): a system turn of the context
        (prompt: earlier words, names, spellings; "" without), a user turn of the audio, and with a forced
        language the assistant turn it opens with, "language {Language}<asr_text>" (`chat_inputs` reads them)."""
        name = asr_language(language, self.languages)
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string, got {type(prompt).__name__}")
        messages = [{"role": "system", "content": prompt or ""},
                    {"role": "user", "content": [{"type": "audio", "audio": audio}]}]
        if name is not None:
            messages.append({"role": "assistant", "content": f"{LANGUAGE_PREFIX}{name}{ASR_TEXT_TOKEN}"})
        return messages

    def chat_inputs(self, messages: list[dict], limits: MediaLimits) -> tuple[list[int], MediaInputs]:
        """The prompt ids and features of `transcription_messages` (the module docstring's prompt): the context is
        text (special-token strings in it are characters), the audio (a path, a (samples, rate) pair or 16 kHz
        samples) within `limits`. ValueError naming messages for any other conversation: the model transcribes
        one audio."""
        roles = [message.get("role") for message in messages]
        if roles not in (["system", "user"], ["system", "user", "assistant"]):
            raise ValueError("messages: a Qwen3-ASR model takes a system turn (the context) and a user turn of one "
                             "audio (OmniPipeline.transcribe)")
        context, parts = messages[0]["content"], messages[1]["content"]
        if not isinstance(context, str) or not isinstance(parts, list) or len(parts) != 1 \
                or parts[0].get("type") != "audio":
            raise ValueError("messages: a Qwen3-ASR model takes a text context and one audio part")
        prefix = messages[2]["content"] if len(messages) == 3 else None
        names = {f"{LANGUAGE_PREFIX}{name}{ASR_TEXT_TOKEN}" for name in self.languages}
        if prefix is not None and prefix not in names:
            raise ValueError("messages: the assistant turn must be 'language {Language}<asr_text>' of a language of "
                             "the model")
        samples = load_audio(parts[0]["audio"], self.processor.feature_extractor.sampling_rate, limits, "audio")
        media = self.processor.features(samples)
        num_rows = self.audio_rows(media.audio_lengths)[0]
        tokens = prompt_tokenizer(self.tokenizer)
        template = _AsrTemplate()
        if not tokens.has_special_text([context]):
            rendered = template.apply_chat_template(messages[:2])
            ids = self.tokenizer.encode(_expand_audio(rendered, num_rows), add_special_tokens=False)
        else:
            rendered, restore = tokens.rendered(messages[:2], renderer=template)
            ids = []
            for piece in tokens.pieces(_expand_audio(rendered, num_rows)):
                ids.extend([piece] if isinstance(piece, int) else tokens.encode(restore(piece)))
        if prefix is not None:
            ids += self.tokenizer.encode(prefix, add_special_tokens=False)
        return ids, media

    def parse_transcript(self, reply: str, language: str | None = None) -> tuple[str | None, str]:
        """The raw reply → (language, text) (`parse_transcript`); language: the forced one (an ISO code or a
        name), or None: then the one the model named."""
        return parse_transcript(reply, asr_language(language, self.languages))

    def transcript_deltas(self, language: str | None = None) -> TranscriptDeltas:
        """The text deltas of a reply as it is written: without a forced language the "language X<asr_text>" it
        opens with is held back (`TranscriptDeltas`); with one the reply is the text. Either way the deltas join
        to `parse_transcript`'s text."""
        return TranscriptDeltas(strips=True, holds_tag=language is None, tag=ASR_TEXT_TOKEN)

    def check_media(self, prompt_ids: list[int], media: MediaInputs | None) -> None:
        """ValueError unless the prompt holds one `<|audio_pad|>` run of the audio's encoder rows per audio."""
        config = self.model.thinker.config
        if media is None or not media.has_audio or media.has_vision:
            raise ValueError("prompt: a Qwen3-ASR request takes audio (and no image or video)")
        expected = self.audio_rows(media.audio_lengths)
        runs, run = [], 0
        for token in [*prompt_ids, None]:
            if token == config.audio_token_id:
                run += 1
            elif run:
                runs, run = [*runs, run], 0
        if runs != expected:
            raise ValueError(f"prompt: its audio placeholder runs have lengths {runs}, but the audio inputs give "
                             f"{expected} encoder rows")

    def audio_rows(self, lengths: torch.Tensor) -> list[int]:
        """Encoder rows of audios with `lengths` feature frames (the audio tower's downsampling)."""
        n_window = self.model.thinker.config.audio_config.n_window
        return _get_feat_extract_output_lengths(lengths, n_window).tolist()

    def decode_text(self, ids: list[int]) -> str:
        """Reply ids → the raw reply (special tokens skipped, `<asr_text>` kept: `parse_transcript` reads it)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # --- thinker ---

    def new_thinker(self, prompts: list[list[int]], sampling: list[SamplingParams | None],
                    generators: list[torch.Generator], max_new_tokens: int,
                    media: list[MediaInputs | None] | None = None, prefill_block: int | None = None,
                    prefixes: list[PrefixRows | None] | None = None,
                    keeps_prefix: list[bool] | None = None, plain_start_steps: int = 0,
                    logprobs: list[int | None] | None = None) -> ThinkerRun:
        """One thinker run over `prompts` (one KV slot each), each with its own sampling, generator and audio."""
        return ThinkerRun(
            self.thinker, prompts, accept_hidden_layer=self.accept_hidden_layer, eos_token_ids=self.eos_token_ids,
            max_new_tokens=max_new_tokens, sampling=sampling, generators=generators, decoder=self.thinker_decoder,
            media=media, prefill_block=prefill_block, prefixes=prefixes, keeps_prefix=keeps_prefix,
            logprobs=logprobs, prefill_decoder=self.prefill_decoder,
        )

    def new_talker_batch(self, max_batch_size: int) -> _NoTalker:
        return _NoTalker()


def _expand_audio(prompt: str, num_rows: int) -> str:
    """The prompt with its one `<|audio_pad|>` repeated once per encoder row (the reference processor's
    expansion)."""
    return prompt.replace("<|audio_pad|>", "<|audio_pad|>" * num_rows, 1)
