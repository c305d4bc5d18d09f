"""End-to-end omni speech: thinker → talker → codec, as a Python API, for Qwen3-Omni (talker + code predictor
→ code2wav) and Qwen2.5-Omni (single-codebook talker → token2wav); and text → speech for Qwen3-TTS (talker +
code predictor → the 12 Hz speech tokenizer's decoder, no thinker).

`OmniPipeline` is a synchronous driver of the engine core (`omnimtp.engine.core.EngineCore`): it turns
prompts into requests, steps the core until they are done and hands out the events. `stream` streams:
the talker starts on each request's streamed handoff (chunk 0 as soon as it exists) and audio goes out in
chunks (`EngineConfig.first_chunk_frames`, then `chunk_frames`). `generate` does what transformers'
`generate` does: each request's talker inputs are built from all its thinker rows once its reply is
written (one text projection over the reply, bit for bit transformers' call) and its audio is decoded
in one block when its talker ends. The server runs the same core, so a request served over HTTP gives
the same text and PCM as here.

    pipe = OmniPipeline.tiny()              # Qwen3-Omni; OmniPipeline.tiny(family="qwen2_5"): Qwen2.5-Omni
    out = pipe.generate("Hello")            # OmniOutput(text, text_ids, codes [G, T], audio, sample_rate, ...)
    for event in pipe.stream("Hello"):      # OmniEvent(text delta, audio chunk or None, finish_reason)
        ...
    pipe.generate([{"role": "user", "content": [{"type": "audio", "audio": "question.wav"}]}])   # a spoken question

    tts = OmniPipeline.from_pretrained("Qwen3-TTS-12Hz-0.6B-CustomVoice")   # or OmniPipeline.tiny(family="qwen3_tts")
    out = tts.speech("Hello there", voice="aiden", language="english")      # OmniOutput(codes [16, T], audio, ...)
    for item in tts.stream_speech("Hello there"):                          # audio chunks, then the OmniOutput
        ...

    base = OmniPipeline.from_pretrained("Qwen3-TTS-12Hz-0.6B-Base")         # voice cloning
    voice = base.create_voice("ref.wav", ref_text="What the recording says.")  # a Voice: voice.save("me.safetensors")
    out = base.speech("Hello there", voice=voice)
    session = tts.speech_session(voice="aiden")                            # text that is still being written
    chunks = session.push("Hello ") + session.push("there") + session.finish()
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from omnimtp.checkpoint import CAPS_FILE, MODEL_TYPES, is_shipped, omni_model_type, saved_caps, tiny_model
from omnimtp.codec.streaming import codec_dtype_of
from omnimtp.console import progress_bars_off, quiet_expected_warnings
from omnimtp.engine.core import EngineConfig, EngineCore
from omnimtp.engine.request import OmniOutput, Request
from omnimtp.engine.warm_up import warm_up_request
from omnimtp.families import family_class
from omnimtp.families.asr_stream import PartialTranscript, RecognitionStep, StreamingRecognition
from omnimtp.families.qwen3_omni import SAMPLE_RATE
from omnimtp.limits import DEFAULT_TIMEOUT_TEXT_IDLE_S, check_seconds
from omnimtp.media import MediaInputs, MediaLimits, load_audio, load_processor
from omnimtp.quantized_checkpoint import is_quantized_checkpoint, load_quantized_model
from omnimtp.runtime.device import apply_thread_rule, resolve_device
from omnimtp.runtime.prefetch import start_prefetch
from omnimtp.sampling import SamplingParams, row_seeds
from omnimtp.spec_decode.thinker_spec import thinker_speculation
from omnimtp.speech_session import SpeechSession
from omnimtp.voice import Voice

__all__ = [
    "OmniEvent", "OmniOutput", "OmniPipeline", "SAMPLE_RATE", "SpeechSession", "Transcription", "TranscriptionSegment",
]

MEDIA_ARGUMENTS = (
    "input_features", "feature_attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
    "video_grid_thw", "video_second_per_grid",
)


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
class TranscriptionSegment:
    """A stretch of the audio and its text (OpenAI's verbose_json segment). start, end: seconds."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int]


@dataclass
class Transcription:
    """What `OmniPipeline.transcribe` heard. The model writes no timestamps, so there is one segment: the whole
    text over the whole audio (start 0, end = duration). language: the hint given, the language a Qwen3-ASR
    model named ("English"), or None."""

    text: str
    text_ids: list[int]
    duration: float
    language: str | None
    finish_reason: str
    segments: list[TranscriptionSegment]


class OmniPipeline:
    """Text, audio and images (also as media parts of chat messages) and video → text + speech.
    See the module docstring."""

    def __init__(
        self, model=None, tokenizer=None, *, max_batch_size: int = 8, max_new_tokens: int | None = None,
        max_frames: int | None = None, compile_predictor: bool | str = False, processor=None,
        media_limits: MediaLimits | None = None, family=None, thinker_mtp=None, num_draft_tokens: int | None = None,
        torch_threads: int | None = None,
        quantize: str | None = None, max_segment_tokens: int | None = None, codec_dtype: str | None = None,
        stored: dict | None = None, prefetch: bool = True,
    ):
        """max_new_tokens, max_frames: the default caps (default `EngineConfig`'s); max_segment_tokens: the text
        tokens of one segment of a spoken text, longer texts are spoken in segments (default `EngineConfig`'s).
        compile_predictor: `CodePredictorRunner`'s compile mode. False: eager; "step" (or True): each predictor
        step is one compiled graph (tens of seconds per batch size on a CPU); "frame": the whole frame is one graph
        (a minute or more per batch size the first time, seconds once inductor's disk cache has it), the
        fastest; "auto": "frame" unless the predictor runs omnimtp's native w4a8 step, as fast eagerly (then
        eager). Worth it for a long-lived pipeline, not for a one-shot command. processor: the checkpoint's
        audio and image processor (None: chat messages with media parts are refused); media_limits: what
        such a part may hold (`omnimtp.media.MediaLimits`). family: a ready family
        (`Qwen3OmniFamily`, `Qwen2_5OmniFamily`) instead of model, tokenizer and processor; else the family
        follows the model's `config.model_type`. thinker_mtp (Qwen3-Omni): speculative thinker steps drafted
        by the thinker's MTP head (a directory holding it, an `MTPHead`) or any `Proposer`, k =
        num_draft_tokens (default 3) drafts per step; greedy text is token for token the plain loop's,
        sampled text has the thinker's distribution (`omnimtp.spec_decode.thinker_spec`). torch_threads: torch's
        CPU threads (`omnimtp.runtime.device.apply_thread_rule`: default one for a small model such as the
        built-in tiny ones, the cores for a real one). quantize: None (the

        weights as they are), "int8" (per output channel) or "int4" (per output channel and group of 128
        inputs): every dense linear of the thinker, talker and code predictor weight-only quantized, run
        on omnimtp's CPU kernel (activations stay float; a CPU with AVX2 or AVX-512F and a C compiler);
        or "w4a8": int4 weights, each linear's input rounded to int8 per row and group of 128 as it runs
        (exact integer sums; AVX512-VNNI where the CPU has it); with a ready family, give it to the family.
        codec_dtype (Qwen3-Omni): code2wav's conv stack in "float32" or "bfloat16" (None: in the model's dtype),
        on a copy of the stack where the model's is in another (the model's own is left as it is); bfloat16 is
        faster on a CPU with bf16 instructions and less exact than float32 (docs/speech.md states by how much);
        with a ready family, give it to the family. stored: the quantized layers of a quantized checkpoint
        (`omnimtp.quantized_checkpoint.load_quantized_model`, which `from_pretrained` calls for one), with quantize
        their mode. prefetch: read the memory-mapped weights every spoken reply uses (the family's
        `per_request_tensors`: a quantized checkpoint's) in the background from now on
        (`omnimtp.runtime.prefetch`), so the first reply does not page them in; `warm_up` waits for it."""
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be a bool, got {prefetch!r}")
        defaults = EngineConfig()
        self.config = EngineConfig(
            max_batch_size=max_batch_size,
            max_new_tokens=defaults.max_new_tokens if max_new_tokens is None else max_new_tokens,
            max_frames=defaults.max_frames if max_frames is None else max_frames,
            max_segment_tokens=defaults.max_segment_tokens if max_segment_tokens is None else max_segment_tokens,
        )
        if (family is None) == (model is None):
            raise ValueError("model: give exactly one of model or family")
        if family is not None and quantize is not None:
            raise ValueError("quantize: give it to the family (e.g. Qwen3TTSFamily(..., quantize=))")
        if family is not None and codec_dtype is not None:
            raise ValueError("codec_dtype: give it to the family (e.g. Qwen3OmniFamily(..., codec_dtype=))")
        if family is not None and (thinker_mtp is not None or num_draft_tokens is not None):
            raise ValueError("thinker_mtp: give the speculation to the family (Qwen3OmniFamily(thinker_speculation=))")
        if family is None:
            model_type = model.config.model_type
            if model_type not in MODEL_TYPES:
                raise ValueError(f"model: a {model_type!r} model; supported: {sorted(MODEL_TYPES)}")
            check_codec_dtype(codec_dtype, model_type)
            apply_thread_rule(model, torch_threads)  # the family packs (and quantizes) on the rule's threads
            if model_type == "qwen2_5_omni":
                if thinker_mtp is not None or num_draft_tokens is not None:
                    raise ValueError(
                        "thinker_mtp: speculative thinker steps are for Qwen3-Omni's thinker, not Qwen2.5-Omni's"
                    )
                family = family_class(model_type)(model, tokenizer, processor=processor, quantize=quantize,
                                                  stored=stored)
            else:
                speculation = thinker_speculation(model.thinker, thinker_mtp, num_draft_tokens)
                family = family_class(model_type)(
                    model, tokenizer, processor=processor, compile_predictor=compile_predictor,
                    thinker_speculation=speculation, quantize=quantize, codec_dtype=codec_dtype, stored=stored,
                )
        else:
            apply_thread_rule(family.model, torch_threads)
        self.family = family
        self.media_limits = media_limits or MediaLimits()
        self.prefetch = start_prefetch(family) if prefetch else None

    def warm_up(self, prompt_ids: list[int] | None = None) -> dict:
        """Make the first request as fast as the ones after it: wait for the prefetch of the mapped weights
        (`prefetch`), then run one short spoken reply through every stage and drop it
        (`omnimtp.engine.warm_up.warm_up_request` of `prompt_ids`: None, a greeting in the tokenizer's chat template;
        a family that does not speak, or a checkpoint without a chat template and no prompt_ids, runs none).
        Returns {"prefetch": the prefetch's summary (`omnimtp.runtime.prefetch.Prefetch.summary`) or None,
        "reply_s": the reply's seconds or None}."""
        summary = {"prefetch": None, "reply_s": None}
        if self.prefetch is not None:
            self.prefetch.wait()
            summary["prefetch"] = self.prefetch.summary()
        request = warm_up_request(self.family, self.config, prompt_ids)
        if request is not None:
            started = time.perf_counter()
            core = EngineCore(self.family, self.config)
            core.add(request)
            while core.has_work():
                for _ in core.step():
                    pass
            summary["reply_s"] = time.perf_counter() - started
        return summary

    @property
    def model(self):
        return self.family.model

    @property
    def tokenizer(self):
        return self.family.tokenizer

    @property
    def processor(self):
        return self.family.processor

    @property
    def eos_token_ids(self) -> set[int]:
        return self.family.eos_token_ids

    @property
    def accept_hidden_layer(self) -> int:
        return self.family.accept_hidden_layer

    @property
    def thinker_decoder(self):
        return self.family.thinker_decoder

    @property
    def default_max_frames(self) -> int:
        return self.config.max_frames

    @classmethod
    def tiny(cls, seed: int = 0, device=None, family: str = "qwen3", **kwargs) -> OmniPipeline:
        """The embedded default: a seeded tiny Qwen3-Omni (random weights: its speech is noise-like)
        with the byte-level tokenizer and its processor; short caps keep a run to a few seconds. device:
        where it runs (default the CPU). family: "qwen3", "qwen2_5" (a tiny Qwen2.5-Omni, its byte
        tokenizer and its processor), "qwen3_tts" (a tiny Qwen3-TTS: CustomVoice with the speakers aiden,
        vivian and eric (a Sichuan-dialect speaker) and the languages english and chinese; `tts_model_type=
        "voice_design"` for its VoiceDesign twin, "base" for its Base (voice-clone) twin) or "qwen3_asr" (a tiny
        Qwen3-ASR in the released layout: it transcribes). kwargs:
        `OmniPipeline`'s (e.g. thinker_mtp, Qwen3 only)."""
        from omnimtp.limits import TINY_MAX_FRAMES, TINY_MAX_NEW_TOKENS

        quiet_expected_warnings()
        tts_model_type = kwargs.pop("tts_model_type", "custom_voice")
        quantize = kwargs.pop("quantize", None)
        codec_dtype = kwargs.pop("codec_dtype", None)
        kwargs = {"max_new_tokens": TINY_MAX_NEW_TOKENS, "max_frames": TINY_MAX_FRAMES, **kwargs}
        if family == "qwen3_asr":
            int8_compute, kv_dtype = kwargs.pop("int8_compute", False), kwargs.pop("kv_dtype", None)
            return cls(family=family_class("qwen3_asr").tiny(seed, device=device, quantize=quantize,
                                                             int8_compute=int8_compute, kv_dtype=kv_dtype), **kwargs)
        if family == "qwen3_tts":
            return cls(family=family_class("qwen3_tts").tiny(seed, tts_model_type, device=device, quantize=quantize,
                                                             codec_dtype=codec_dtype), **kwargs)
        if family == "qwen3":
            made = family_class("qwen3_omni_moe").tiny(seed, device=device)
            return cls(made.model, made.tokenizer, processor=made.processor, quantize=quantize,
                       codec_dtype=codec_dtype, **kwargs)
        if family == "qwen2_5":
            check_codec_dtype(codec_dtype, "qwen2_5_omni")
            return cls(family=family_class("qwen2_5_omni").tiny(seed, device=device, quantize=quantize), **kwargs)
        raise ValueError(f"family must be 'qwen3', 'qwen2_5', 'qwen3_tts' or 'qwen3_asr', got {family!r}")

    @classmethod
    def demo(cls, device=None, *, thinker_mtp="shipped", **kwargs) -> OmniPipeline:
        """The shipped demo Qwen3-Omni (`omnimtp.mtp.demo.demo_omni_dir`: a trained byte-level thinker and its
        trained MTP head; random talker), fp32, speculative with the shipped head unless thinker_mtp is None
        (or another drafter); kwargs: `from_pretrained`'s (num_draft_tokens, max_new_tokens, ...)."""
        from omnimtp.mtp.demo import demo_omni_dir

        path = demo_omni_dir()
        return cls.from_pretrained(path, dtype=torch.float32, device=device,
                                   thinker_mtp=path if thinker_mtp == "shipped" else thinker_mtp, **kwargs)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, **kwargs) -> OmniPipeline:
        """A checkpoint directory, or a built-in tiny model's name (`omnimtp.checkpoint.TINY_MODELS`: "tiny",
        "tiny-qwen2.5-omni", "tiny-tts", "tiny-tts-design", "tiny-tts-base", "tiny-asr"; `tiny`). config.json's
        model_type picks the family ("qwen3_omni_moe": Qwen3-Omni,
        "qwen2_5_omni": Qwen2.5-Omni, whose speakers are its spk_dict.pt; "qwen3_tts": Qwen3-TTS in its released
        layout, `Qwen3TTSFamily.from_pretrained`, which also takes non_streaming_mode and codec_dtype; "qwen3_asr":
        Qwen3-ASR in its released layout, `Qwen3ASRFamily.from_pretrained`, which also takes quantize,
        int8_compute and kv_dtype); its
        tokenizer and its processor (audio and images, `omnimtp.media.load_processor`), when it has them; the
        default caps a saved pipeline wrote (`omnimtp.checkpoint.CAPS_FILE`) unless kwargs give them."""
        import transformers
        from transformers import AutoTokenizer

        quiet_expected_warnings()
        path = os.fspath(path)
        tiny = tiny_model(path)
        if tiny is not None:
            family, tts_model_type = tiny
            kwargs.pop("non_streaming_mode", None)  # (the tiny Qwen3-TTS streams its text)
            tts = {} if tts_model_type is None else {"tts_model_type": tts_model_type}
            return cls.tiny(device=device, family=family, **tts, **kwargs)
        model_type = omni_model_type(path)
        kwargs = {**saved_caps(path), **kwargs}
        # `omnimtp quantize`'s copy of an omnimtp model (Qwen3-TTS, Qwen3-ASR): memory-mapped, its mode, CPU only
        quantized = None
        if model_type in ("qwen3_asr", "qwen3_tts") and is_quantized_checkpoint(path):
            quantized = load_quantized_model(path, kwargs.get("quantize"), dtype=dtype)
        if model_type == "qwen3_asr":
            quantize, int8_compute = kwargs.pop("quantize", None), kwargs.pop("int8_compute", False)
            kv_dtype = kwargs.pop("kv_dtype", None)
            return cls(family=family_class(model_type).from_pretrained(
                path, dtype=dtype, device=device, quantize=quantize, quantized=quantized, int8_compute=int8_compute,
                kv_dtype=kv_dtype), **kwargs)
        if model_type == "qwen3_tts":
            family_options = {
                name: kwargs.pop(name)
                for name in ("non_streaming_mode", "compile_predictor", "quantize", "codec_dtype") if name in kwargs
            }
            return cls(family=family_class(model_type).from_pretrained(
                path, dtype=dtype, device=device, quantized=quantized, **family_options), **kwargs)
        check_codec_dtype(kwargs.get("codec_dtype"), model_type)  # before the weights load
        device = None if device is None else resolve_device(device)
        if is_quantized_checkpoint(path):  # `omnimtp quantize`'s: memory-mapped, its mode, CPU only
            if device is not None and device.type != "cpu":
                raise ValueError(f"device: {path!r} is a quantized checkpoint; its kernels run on the CPU only")
            if dtype is not None:
                raise ValueError(f"dtype: {path!r} is a quantized checkpoint; its float tensors load as stored")
            loaded = load_quantized_model(path, kwargs.pop("quantize", None))
            model, device = loaded.model, None
            kwargs.update(quantize=loaded.mode, stored=loaded.stored)
        else:
            with progress_bars_off(is_shipped(path)):
                model = getattr(transformers, MODEL_TYPES[model_type]).from_pretrained(path, dtype=dtype)
        if device is not None:
            model = model.to(device)  # once, before the family packs the weights
        has_tokenizer = any(
            os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
        )
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
        processor = load_processor(path)
        return cls(model, tokenizer, processor=processor, **kwargs)

    def save_pretrained(self, path) -> None:
        """The model (Qwen2.5-Omni: its speakers in spk_dict.pt; Qwen3-TTS: its speech tokenizer's decoder, and
        a Base model's encoder, in speech_tokenizer/), its tokenizer and its processor, in a checkpoint's layout;
        the default caps in CAPS_FILE. A Qwen3-TTS pipeline loaded with codec_dtype="bfloat16" holds rounded
        decoder weights: a ValueError before anything is written."""
        if getattr(self.model, "omnimtp_quantized_checkpoint", None) is not None:
            raise ValueError("path: this pipeline was loaded from a quantized checkpoint, whose float weights are "
                             "not here; copy that directory instead")
        codec = getattr(self.family, "codec", None)
        if self.family.model_type == "qwen3_tts" and codec is not None and codec.conv_dtype != torch.float32:
            raise ValueError(f"path: this pipeline's decoder runs its conv stack in {codec.conv_dtype} (codec_dtype) "
                             "and its float32 weights are gone; save from a pipeline loaded without codec_dtype")
        self.model.save_pretrained(path)
        with open(os.path.join(os.fspath(path), CAPS_FILE), "w") as f:
            json.dump({"max_new_tokens": self.config.max_new_tokens, "max_frames": self.config.max_frames}, f)
        if self.family.model_type == "qwen3_tts":
            if self.family.codec is not None:
                self.family.codec.save_pretrained(os.path.join(os.fspath(path), "speech_tokenizer"))
                if self.family.speech_encoder is not None:  # a Base model's, next to the decoder
                    self.family.speech_encoder.save_pretrained(os.path.join(os.fspath(path), "speech_tokenizer"))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(path)
            return
        if self.family.model_type == "qwen3_asr":
            self.processor.save_pretrained(path)  # preprocessor_config.json and the tokenizer
            return
        if self.model.config.model_type == "qwen2_5_omni":
            torch.save(self.model.speaker_map, os.path.join(os.fspath(path), "spk_dict.pt"))
        if self.processor is not None:
            self.processor.save_pretrained(path)  # its tokenizer too
        elif self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)

    # --- public entry points -----------------------------------------------------------------

    def generate(self, prompt=None, **kwargs) -> OmniOutput | list[OmniOutput]:
        """Text + speech for one prompt (→ OmniOutput) or a list of prompts (→ list). Arguments as `stream`."""
        outputs: dict[int, OmniOutput] = {}
        is_batch = _is_batch(prompt, kwargs.get("input_ids"))
        for event in self._stream(prompt, kwargs, is_streamed=False):
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
        input_features: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
    ) -> Iterator[OmniEvent]:
        """Events as they are ready (see `OmniEvent`). prompt: a string, chat messages, or a list of
        either; or input_ids: token ids (a list, or a list of lists). None sampling = greedy (the talker's
        greedy keeps transformers' repetition penalty 1.05). seed: one per request (an int seeds request
        i with seed + i); a request's output depends only on its own inputs and seed.

        Media: chat messages take parts `{"type": "audio", "audio": path | (array, sample_rate)}` and
        `{"type": "image", "image": path | PIL.Image}` next to text parts; the checkpoint's processor turns
        them into ids and tensors. Or the processor's tensors under transformers' names go with input_ids that hold
        their placeholders (`Qwen3OmniMoeProcessor` / `Qwen2_5OmniProcessor` output: input_features +
        feature_attention_mask, pixel_values + image_grid_thw, pixel_values_videos + video_grid_thw (+
        video_second_per_grid)); for a batch, every prompt's media in prompt order, as the processor batches
        them. Prompts with and without media mix in one call."""
        arguments = {name: value for name, value in locals().items() if name not in ("self", "prompt")}
        yield from self._stream(prompt, arguments, is_streamed=True)

    def _stream(self, prompt, arguments: dict, *, is_streamed: bool) -> Iterator[OmniEvent]:
        """`stream`'s keyword arguments (checked against its signature, for `generate`) → events."""
        bound = inspect.signature(self.stream).bind(prompt, **arguments)  # TypeError on an unknown name
        bound.apply_defaults()
        values = {name: value for name, value in bound.arguments.items() if name != "prompt"}
        media = MediaInputs.from_dict({name: values.pop(name) for name in MEDIA_ARGUMENTS})
        yield from self._events(prompt, media=media, is_streamed=is_streamed, **values)

    def _events(
        self, prompt, *, input_ids=None, speaker=None, thinker_sampling=None, talker_sampling=None,
        max_new_tokens=None, max_frames=None, seed=None, media: MediaInputs | None = None, is_streamed: bool,
    ) -> Iterator[OmniEvent]:
        if not self.family.has_chat:
            raise ValueError("prompt: this model has no chat; it speaks text (OmniPipeline.speech)")
        prompts, media_rows = self._prompts(prompt, input_ids, media)
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        max_frames = self.config.max_frames if max_frames is None else max_frames
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        for i, ids in enumerate(prompts):
            if len(ids) + max_new_tokens > self.family.max_positions:
                raise ValueError(
                    f"prompt: request {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                    f"the thinker's {self.family.max_positions} positions"
                )
        if len(prompts) > self.config.max_batch_size:
            raise ValueError(f"prompt: {len(prompts)} requests, more than max_batch_size={self.config.max_batch_size}")
        speaker = self.family.default_speaker if speaker is None else speaker
        self.family.check_speaker(speaker)
        seeds = row_seeds(seed, len(prompts))
        requests = [
            Request(
                i, ids, max_new_tokens=max_new_tokens, max_frames=max_frames, speaker=speaker,
                thinker_sampling=thinker_sampling, talker_sampling=talker_sampling, seed=s, is_streamed=is_streamed,
                media=m,
            )
            for i, (ids, s, m) in enumerate(zip(prompts, seeds, media_rows, strict=True))
        ]
        yield from self._run(requests)

    def transcribe(self, audio, language: str | None = None, prompt: str | None = None,
                   sampling: SamplingParams | None = None, *, seed: int | None = None,
                   max_new_tokens: int | None = None) -> Transcription:
        """The words spoken in `audio` (a path to any file libsndfile reads, a (samples, sample_rate) pair, or
        16 kHz samples), written by the thinker alone (no talker) as its answer to the family's ASR prompt
        (`ChatText.transcription_messages`). language: a hint, an ISO-639-1 code ("en") or a name; prompt:
        context (earlier words, spellings); sampling: None = greedy; seed: as `generate`'s."""
        request, duration = self._transcription_request(audio, language, prompt, sampling, seed, max_new_tokens,
                                                        is_streamed=False)
        output = next(event.output for event in self._run([request]) if event.output is not None)
        return _transcription(self.family, output, duration, language)

    def stream_transcription(self, audio, language: str | None = None, prompt: str | None = None,
                             sampling: SamplingParams | None = None, *, seed: int | None = None,
                             max_new_tokens: int | None = None) -> Iterator[str | Transcription]:
        """`transcribe` as it is written: text deltas, then the `Transcription` (the one `transcribe` gives)."""
        request, duration = self._transcription_request(audio, language, prompt, sampling, seed, max_new_tokens,
                                                        is_streamed=True)
        deltas = self.family.transcript_deltas(language)
        for event in self._run([request]):
            if event.output is not None:
                if rest := deltas.finish():
                    yield rest
                yield _transcription(self.family, event.output, duration, language)
            elif event.text and (delta := deltas.push(event.text)):
                yield delta

    def stream_recognition(self, audio_chunks, language: str | None = None, prompt: str | None = None, *,
                           chunk_seconds: float = 2.0, unfixed_chunks: int = 2, unfixed_tokens: int = 5,
                           max_new_tokens: int | None = None) -> Iterator[PartialTranscript]:
        """Streaming recognition with a Qwen3-ASR model (`omnimtp.families.asr_stream.StreamingRecognition`:
        the reference's streaming mode): audio_chunks, 16 kHz float (or int16) sample arrays as they arrive, of
        any length → a `PartialTranscript` (the whole text so far) each time chunk_seconds of audio have
        gathered, and the final one, of the tail, last. Each transcription is a greedy engine request over all
        the audio so far, continuing the previous reply less its last unfixed_tokens tokens (none for the first
        unfixed_chunks chunks). language, prompt: as `transcribe`'s."""
        if self.family.model_type != "qwen3_asr":
            raise ValueError("model: streaming recognition needs a Qwen3-ASR model")
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stream = StreamingRecognition(self.family, language, prompt, chunk_seconds=chunk_seconds,
                                      unfixed_chunks=unfixed_chunks, unfixed_tokens=unfixed_tokens)
        for samples in audio_chunks:
            stream.feed(samples)
            while (step := stream.next_step()) is not None:
                yield stream.accept(step, self._recognized(step, max_new_tokens))
        if (step := stream.finish()) is not None:
            yield stream.accept(step, self._recognized(step, max_new_tokens))

    def _recognized(self, step: RecognitionStep, max_new_tokens: int) -> str:
        """The reply to one streaming-recognition step (greedy)."""
        if len(step.prompt_ids) + max_new_tokens > self.family.max_positions:
            raise ValueError(f"audio: {len(step.prompt_ids)} prompt tokens with max_new_tokens={max_new_tokens} "
                             f"exceed the model's {self.family.max_positions} positions")
        request = Request(0, step.prompt_ids, max_new_tokens=max_new_tokens, max_frames=1, speaker=None,
                          media=step.media)
        return next(event.output for event in self._run([request]) if event.output is not None).text

    def _transcription_request(self, audio, language, prompt, sampling, seed, max_new_tokens, *,
                               is_streamed: bool) -> tuple[Request, float]:
        """A text-only request (speaker None: no talker) for the ASR prompt of `audio`, and the audio's seconds."""
        if self.processor is None:
            raise ValueError("model: transcription needs a model that hears audio (an audio processor)")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be None or a SamplingParams, got {type(sampling).__name__}")
        rate = self.processor.feature_extractor.sampling_rate
        samples = load_audio(audio, rate, self.media_limits, "audio")
        ids, media = self.family.transcription_inputs(samples, language, prompt, self.media_limits)
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(ids) + max_new_tokens > self.family.max_positions:
            raise ValueError(f"audio: {len(ids)} prompt tokens with max_new_tokens={max_new_tokens} exceed the "
                             f"thinker's {self.family.max_positions} positions")
        request = Request(0, ids, max_new_tokens=max_new_tokens, max_frames=1, speaker=None,
                          thinker_sampling=sampling, seed=seed, is_streamed=is_streamed, media=media)
        return request, len(samples) / rate

    def _run(self, requests: list[Request]) -> Iterator[OmniEvent]:
        """The requests through one engine core, stepped until they are done."""
        core = EngineCore(self.family, self.config)  # one per call: an abandoned stream leaves nothing behind
        for request in requests:
            core.add(request)
        while core.has_work():
            for event in core.step():
                index = event.request.request_id
                if event.is_finished:
                    output = core.output(event.request)
                    yield OmniEvent(index, finish_reason=output.finish_reason, output=output)
                else:
                    yield OmniEvent(index, text=event.text, audio=event.audio)

    # --- text to speech (Qwen3-TTS) ------------------------------------------------------------

    def create_voice(self, ref_audio=None, ref_text: str | None = None, *, x_vector_only: bool = False,
                     speaker_embedding=None, ref_codes=None, ref_text_ids=None) -> Voice:
        """A reusable cloned voice of a Qwen3-TTS Base model (`Qwen3TTSFamily.create_voice`): the x-vector of
        `ref_audio` (a path or a (samples, sample_rate) pair), and with its transcript `ref_text` (unless
        x_vector_only) its 12 Hz codes for in-context cloning; or precomputed parts. Speak with it through
        `speech(..., voice=voice)`; save it with `voice.save(path)`."""
        if not hasattr(self.family, "create_voice"):
            raise ValueError("ref_audio: voice cloning needs a Qwen3-TTS Base model")
        return self.family.create_voice(ref_audio, ref_text, x_vector_only=x_vector_only,
                                        speaker_embedding=speaker_embedding, ref_codes=ref_codes,
                                        ref_text_ids=ref_text_ids)

    def speech(
        self, text=None, *, input_ids=None, voice=None, language: str | None = None, instructions: str | None = None,
        sampling: SamplingParams | None = None, seed: int | list[int | None] | None = None,
        max_frames: int | None = None, ref_audio=None, ref_text: str | None = None, x_vector_only: bool = False,
    ) -> OmniOutput | list[OmniOutput]:
        """`text` spoken (→ OmniOutput: codes [G, T], float32 audio at `sample_rate`, finish_reason), or a list
        of texts (→ a list). input_ids instead of text: the ids of the assistant-text template
        `<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n` (a list, or a list of lists), what the
        reference's processor gives. voice: a CustomVoice speaker name (case-insensitive; None: the model's
        default); language: a language of the model or None / "auto"; instructions: the VoiceDesign voice
        description (or a CustomVoice 1.7B model's style). voice, language and instructions are one value for
        every text or a list with one per text. sampling: None = greedy (with the repetition penalty 1.05, as
        the reference's `generate`), or a `SamplingParams` for the talker (the code predictor samples the same
        way without the penalty; `QWEN3_TTS_SAMPLING` is the reference's default); seed: one per request (an
        int seeds request i with seed + i). The audio is decoded in one block when a request's frames end.
        Cloning (a Base model): voice is a `Voice` from `create_voice` (or a list, one per text), or ref_audio
        / ref_text clone inline (as `create_voice`, one voice for every text); x_vector_only=True speaks a
        voice from its x-vector alone."""
        voice = self._clone_voice(voice, ref_audio, ref_text, x_vector_only)
        requests, is_batch = self._speech_requests(text, input_ids, voice, language, instructions, sampling, seed,
                                                   max_frames, is_streamed=False)
        outputs = {event.index: event.output for event in self._run(requests) if event.output is not None}
        ordered = [outputs[i] for i in sorted(outputs)]
        return ordered if is_batch else ordered[0]

    def stream_speech(
        self, text=None, *, input_ids=None, voice=None, language: str | None = None, instructions: str | None = None,
        sampling: SamplingParams | None = None, seed: int | None = None, max_frames: int | None = None,
        ref_audio=None, ref_text: str | None = None, x_vector_only: bool = False,
    ) -> Iterator[np.ndarray | OmniOutput]:
        """One text spoken as it is made: float32 audio chunks (the first after `EngineConfig.first_chunk_frames`
        frames, then every `chunk_frames`), then the `OmniOutput`. Arguments as `speech`, for one text."""
        voice = self._clone_voice(voice, ref_audio, ref_text, x_vector_only)
        requests, is_batch = self._speech_requests(text, input_ids, voice, language, instructions, sampling, seed,
                                                   max_frames, is_streamed=True)
        if is_batch:
            raise ValueError("text: stream_speech speaks one text; use speech for a list")
        for event in self._run(requests):
            if event.output is not None:
                yield event.output
            elif event.audio is not None:
                yield event.audio

    def _clone_voice(self, voice, ref_audio, ref_text, x_vector_only):
        """speech's voice with the inline clone arguments applied: a Voice made from ref_audio / ref_text, or
        the given Voices without their in-context part when x_vector_only."""
        if not isinstance(x_vector_only, bool):
            raise ValueError(f"x_vector_only: expected a bool, got {type(x_vector_only).__name__}")
        if ref_audio is not None:
            if voice is not None:
                raise ValueError("ref_audio: give either a voice or ref_audio to clone, not both")
            return self.create_voice(ref_audio, ref_text, x_vector_only=x_vector_only)
        if ref_text is not None:
            raise ValueError("ref_text: a transcript goes with ref_audio (or is part of a Voice from create_voice)")
        if x_vector_only:
            voices = voice if isinstance(voice, (list, tuple)) else [voice]
            if not voices or not all(isinstance(v, Voice) for v in voices):
                raise ValueError("x_vector_only: applies to cloned voices (a Voice, or ref_audio)")
            stripped = [v.x_vector_only() for v in voices]
            return stripped if isinstance(voice, (list, tuple)) else stripped[0]
        return voice
    def speech_session(
        self, *, voice=None, language: str | None = None, instructions: str | None = None,
        sampling: SamplingParams | None = None, seed: int | None = None, max_frames: int | None = None,
        text_idle_timeout: float = DEFAULT_TIMEOUT_TEXT_IDLE_S,
    ) -> SpeechSession:
        """Speech of a text that is still being written (an LLM's reply as it comes): push text in pieces, take
        the audio chunks as the talker makes them (`SpeechSession`). The talker waits for text it has not got,
        so the codes are those of `speech(whole text)` and the chunks those of `stream_speech(whole text)`, bit
        for bit, however the text was split. Arguments as `stream_speech`; on a Qwen3-Omni / Qwen2.5-Omni model
        (its speech path: the text spoken as if the thinker had replied with it) voice is one of its speakers
        (None: the model's default), language and instructions are refused and sampling samples the talker as
        transformers' `generate` does by default. text_idle_timeout: the seconds the talker may wait for more
        text (the server's `--timeout-text-idle`, same default); a session whose text stops coming for longer is
        ended at its next `push` or `finish`, which raises TimeoutError (its request is dropped and its talker
        state freed)."""
        text_idle_timeout = check_seconds("text_idle_timeout", text_idle_timeout)
        family = self.family
        if hasattr(family, "voice"):
            speaker, talker_sampling = family.voice(voice, language, instructions), sampling
        else:
            for name, value in (("language", language), ("instructions", instructions)):
                if value is not None:
                    raise ValueError(f"{name}: this model takes no {name} (only Qwen3-TTS models do)")
            speaker = family.default_speaker if voice is None else voice
            family.check_speaker(speaker)
            talker_sampling = family.sampled_talker(sampling)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be None or a SamplingParams, got {type(sampling).__name__}")
        max_frames = self.config.max_frames if max_frames is None else max_frames
        request = Request(0, [], max_new_tokens=1, max_frames=max_frames, speaker=speaker,
                          talker_sampling=talker_sampling, seed=seed, is_chat=False, is_streamed=True,
                          is_text_finished=False)
        text = family.streamed_speech_segments(speaker, max_frames, self.config.max_segment_tokens)
        return SpeechSession(EngineCore(family, self.config), request, text, text_idle_timeout)

    def _speech_requests(self, text, input_ids, voice, language, instructions, sampling, seed, max_frames, *,
                         is_streamed: bool) -> tuple[list[Request], bool]:
        family = self.family
        if not family.speaks:
            raise ValueError("text: this model does not speak; it transcribes audio (transcribe)")
        if not hasattr(family, "voice"):
            raise ValueError("text: this model speaks its chat replies; use generate or stream")
        if (text is None) == (input_ids is None):
            raise ValueError("text: give exactly one of text or input_ids")
        if input_ids is not None:
            is_batch = _is_batch(None, input_ids)
            if isinstance(input_ids, torch.Tensor):
                input_ids = input_ids.tolist()
            rows = [[int(t) for t in row] for row in (input_ids if is_batch else [input_ids])]
            if not rows:
                raise ValueError("input_ids: no ids")
            for ids in rows:
                family.check_speech_ids(ids)
        else:
            is_batch = isinstance(text, (list, tuple))
            texts = list(text) if is_batch else [text]
            if not texts:
                raise ValueError("text: empty text")
            rows = texts  # tokenized as they are cut (speech_segments)
        num_rows = len(rows)
        if num_rows > self.config.max_batch_size:
            raise ValueError(f"text: {num_rows} texts, more than max_batch_size={self.config.max_batch_size}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be None or a SamplingParams, got {type(sampling).__name__}")
        max_frames = self.config.max_frames if max_frames is None else max_frames
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
            raise ValueError(f"max_frames must be an integer >= 1, got {max_frames!r}")
        voices = [
            family.voice(v, lang, i) for v, lang, i in zip(
                *(_per_row(name, value, num_rows) for name, value in
                  (("voice", voice), ("language", language), ("instructions", instructions))),
                strict=True,
            )
        ]
        if input_ids is not None:  # ids are spoken as they are, in one segment
            segments = [iter([ids]) for ids in rows]
            for i, (ids, row_voice) in enumerate(zip(rows, voices, strict=True)):
                if family.talker_positions(ids, row_voice, max_frames) > family.max_positions:
                    raise ValueError(f"max_frames: request {i} with {max_frames} frames exceeds the talker's "
                                     f"{family.max_positions} positions")
        else:  # a long text is spoken in segments, each cut as it starts
            segments = [family.speech_segments(t, row_voice, max_frames, self.config.max_segment_tokens)
                        for t, row_voice in zip(texts, voices, strict=True)]
        seeds = row_seeds(seed, num_rows)
        requests = [
            Request(i, next(row), max_new_tokens=1, max_frames=max_frames, speaker=row_voice,
                    talker_sampling=sampling, seed=s, is_chat=False, is_streamed=is_streamed, segments=row)
            for i, (row, row_voice, s) in enumerate(zip(segments, voices, seeds, strict=True))
        ]
        return requests, is_batch

    # --- inputs -----------------------------------------------------------------------------

    def _prompts(
        self, prompt, input_ids, media: MediaInputs | None
    ) -> tuple[list[list[int]], list[MediaInputs | None]]:
        """The requests' prompt ids and media: input_ids with the batch's media tensors split per prompt,
        or prompts (strings, chat messages) whose audio / image parts the checkpoint's processor turns
        into ids and tensors."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of prompt or input_ids")
        if input_ids is not None:
            if isinstance(input_ids, torch.Tensor):
                input_ids = input_ids.tolist()
            rows = input_ids if input_ids and isinstance(input_ids[0], (list, tuple)) else [input_ids]
            prompts = [[int(t) for t in row] for row in rows]
            if not prompts or any(len(p) == 0 for p in prompts):
                raise ValueError("prompt: empty prompt")
            return prompts, self.family.split_media(prompts, media)
        if media is not None:
            raise ValueError("input_ids: media tensors go with input_ids that hold their placeholders")
        if self.tokenizer is None:
            raise ValueError("prompt: this checkpoint has no tokenizer; pass input_ids")
        items = prompt if _is_batch(prompt, None) else [prompt]
        if not items:
            raise ValueError("prompt: empty prompt")
        encoded = [self._encode(item) for item in items]
        return [ids for ids, _ in encoded], [item_media for _, item_media in encoded]

    def _encode(self, item) -> tuple[list[int], MediaInputs | None]:
        if isinstance(item, str):
            if not item.strip():
                raise ValueError("prompt: empty prompt")
            item = [{"role": "user", "content": item}]
        if not isinstance(item, list) or not all(isinstance(m, dict) for m in item) or not item:
            raise ValueError("prompt: expected a string or a non-empty list of chat messages")
        return self.family.chat_inputs(item, self.media_limits)


def _transcription(family, output: OmniOutput, duration: float, language: str | None) -> Transcription:
    language, text = family.parse_transcript(output.text, language)
    segment = TranscriptionSegment(0, 0.0, duration, text, list(output.text_ids))
    return Transcription(text, list(output.text_ids), duration, language, output.finish_reason, [segment])


def _per_row(name: str, value, num_rows: int) -> list:
    """A per-request argument: one value for every row, or a list with one per row."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_rows:
            raise ValueError(f"{name}: {len(value)} values for {num_rows} texts")
        return list(value)
    return [value] * num_rows


def _is_batch(prompt, input_ids) -> bool:
    if input_ids is not None:
        if isinstance(input_ids, torch.Tensor):
            return input_ids.dim() == 2
        return bool(input_ids) and isinstance(input_ids[0], (list, tuple))
    if isinstance(prompt, list) and prompt:
        return isinstance(prompt[0], (str, list))
    return False


def check_codec_dtype(codec_dtype, model_type: str) -> None:
    """ValueError naming codec_dtype unless it is None or one of `omnimtp.codec.streaming.CODEC_DTYPES`, and
    None or "float32" for Qwen2.5-Omni: only the conv stacks of Qwen3-Omni's code2wav and Qwen3-TTS's 12 Hz
    decoder run in another dtype (Qwen2.5-Omni's token2wav does not)."""
    codec_dtype_of(codec_dtype)
    if model_type == "qwen2_5_omni" and codec_dtype not in (None, "float32"):
        raise ValueError(f"codec_dtype: Qwen2.5-Omni's token2wav runs in float32 only, got {codec_dtype!r}")
