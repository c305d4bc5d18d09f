"""Qwen3-TTS behind the engine's family interface: text → talker prefill, the talker batch with the code
predictor, the 12 Hz speech tokenizer's decoder as the codec.

Qwen3-TTS has no thinker: every request is a speech request (`Request(is_chat=False)`), whose prompt ids
are the assistant-text template `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` and
whose `speaker` is a `TTSVoice` (speaker, language and instructions resolved against the model). The engine
core admits it straight into the talker through `speech_talker_inputs`, and the talker runs on the same
`TalkerBatch` and `CodePredictorRunner` as Qwen3-Omni's (`Qwen3FrameMaker` with Qwen3-TTS's settings).

Talker prefill (the reference's `Qwen3TTSForConditionalGeneration.generate`; T(x) = text_projection(
text_embedding(x)), C(x) = the talker's codec embedding):

    [T(<|im_start|>user\\n{instructions}<|im_end|>\\n)]          instructions, when given (a user turn)
    T(<|im_start|>assistant\\n)                                  3 rows, text only
    T(tts_pad) x (n - 1), T(tts_bos)  +  C(codec rows[:-1])      codec rows: [nothink, think_bos, think_eos]
                                                                 or [think, think_bos, language, think_eos],
                                                                 then the speaker (CustomVoice), pad, bos
    T(first text token) + C(bos)
    trailing text = T(each other text token), T(tts_eos)         one row per frame, then T(tts_pad)

`non_streaming_mode=True` (the reference's other layout) puts the whole text in the prefill instead:
... T(tts_pad)s + C(rows[:-1]), then T(text) ++ T(tts_eos) + C(pad) each, then T(tts_pad) + C(bos); no
trailing text. The prefill's projections are made in the reference's calls (the same row groups), so it is
bit for bit the reference's; each trailing row is projected alone (`speech_text_rows`), so text that arrives in
pieces (`speech_stream`) gets the same rows as the whole text.

    family = Qwen3TTSFamily.from_pretrained(path)       # or Qwen3TTSFamily.tiny()
    core = EngineCore(family, EngineConfig())
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from omnimtp.codec.speech_encoder import (
    SpeechTokenizerEncoder,
    tiny_speech_tokenizer_encoder,
)
from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder, tiny_speech_tokenizer
from omnimtp.codec.streaming import codec_dtype_of
from omnimtp.families.text import ChatText, match_speaker
from omnimtp.handoff import SpeechTextStream, TalkerInputs
from omnimtp.limits import MAX_REF_AUDIO_SECONDS, MIN_REF_AUDIO_SECONDS, MediaLimits
from omnimtp.models.qwen3_tts import Qwen3TTSModel
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.runtime.ops import check_quantize, linear, quantize_weight
from omnimtp.sampling import SamplingParams
from omnimtp.talker.code_predictor import CodePredictorRunner, pack_predictor_weights
from omnimtp.talker.loop import Qwen3FrameMaker, TalkerBatch
from omnimtp.tokenizer import StreamedTextIds
from omnimtp.voice import Voice

SAMPLE_RATE = 24_000

# Qwen3-TTS's `generate` defaults: greedy keeps the repetition penalty; sampled, the talker and (without the
# penalty) the code predictor use T 0.9, top-k 50, top-p 1.0.
QWEN3_TTS_TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.05)
QWEN3_TTS_SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
MIN_NEW_TOKENS = 2  # talker tokens before codec EOS may be sampled (the reference's min_new_tokens)
NUM_TEMPLATE_HEAD = 3  # <|im_start|> assistant \n
NUM_TEMPLATE_TAIL = 5  # <|im_end|> \n <|im_start|> assistant \n
TEMPLATE_HEAD, TEMPLATE_TAIL = "<|im_start|>assistant\n", "<|im_end|>\n<|im_start|>assistant\n"
AUTO_LANGUAGE = "auto"
DEFAULT_VOICE = "vivian"


@dataclass(frozen=True)
class TTSVoice:
    """A speech request's voice, resolved against the model: speaker (a CustomVoice speaker id, the
    config's lower-case name) or None, language_id (the codec language row) or None (auto), instruct_ids
    (the user turn of the instructions) or None, clone (a Base model's cloned `omnimtp.voice.Voice`,
    checked against the model: its x-vector is the speaker row, its reference codes and transcript, when it
    has them, the in-context prompt) or None. The clone is not part of equality (compare voices by their parts)."""

    speaker: str | None = None
    speaker_id: int | None = None
    language_id: int | None = None
    instruct_ids: tuple[int, ...] | None = None
    clone: Voice | None = field(default=None, compare=False)

    @property
    def num_reference_rows(self) -> int:
        """Prefill rows the in-context prompt adds: the transcript's and the reference frames' (+ codec bos)."""
        if self.clone is None or self.clone.ref_codes is None:
            return 0
        return len(self.clone.ref_text_ids) + self.clone.ref_codes.shape[1] + 1


class Qwen3TTSFamily(ChatText):
    """Qwen3-TTS's side of the engine (see the module docstring).

    model: `omnimtp.models.qwen3_tts.Qwen3TTSModel`; tokenizer: its text tokenizer, or None (then requests
    come as input_ids of the assistant-text template and no instructions are taken as text). codec: the
    12 Hz speech tokenizer's decoder (`omnimtp.codec.speech_tokenizer.SpeechTokenizerDecoder`), or None: codes
    only (every output's audio is empty). non_streaming_mode: the reference's other prompt layout (the whole text in the
    prefill). compile_predictor: `CodePredictorRunner`'s compile mode. speech_encoder: a Base model's 12 Hz
    tokenizer encoder (`omnimtp.codec.speech_encoder.SpeechTokenizerEncoder`) for in-context clones, or None
    (x-vector clones only)."""

    model_type = "qwen3_tts"  # the checkpoint's config.json model_type
    sample_rate = SAMPLE_RATE
    codec_looks_ahead = False  # the 12 Hz decoder is causal
    has_chat = False
    default_sampling = QWEN3_TTS_SAMPLING  # a sampled request's settings where it gives none (the reference's)
    # the module paths of the decoders the family packs (and quantizes): the talker's and the code predictor's
    decoder_paths = ("talker.model", "talker.code_predictor.model")

    def __init__(self, model: Qwen3TTSModel, tokenizer=None, *, codec=None, non_streaming_mode: bool = False,
                 compile_predictor: bool | str = False, speech_encoder: SpeechTokenizerEncoder | None = None,
                 quantize: str | None = None, stored: dict | None = None):
        check_quantize(quantize, model.talker.device)
        stored = stored or {}
        self.quantize = quantize
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.codec = codec
        self.speech_encoder = speech_encoder
        if codec is not None:
            self.sample_rate = codec.sample_rate
        self.non_streaming_mode = bool(non_streaming_mode)
        self.compile_predictor = compile_predictor
        config = model.config
        talker_config = config["talker_config"]
        self.tts_model_type = config["tts_model_type"]
        self.tts_model_size = config.get("tts_model_size")
        self.speaker_ids = {name.lower(): int(i) for name, i in (talker_config.get("spk_id") or {}).items()}
        self.speaker_dialects = {name.lower(): d for name, d in (talker_config.get("spk_is_dialect") or {}).items()}
        self.language_ids = {name.lower(): int(i) for name, i in (talker_config.get("codec_language_id") or {}).items()}
        # what `language` takes: the non-dialect languages (a dialect comes with its speaker)
        self.languages = tuple(sorted(name for name in self.language_ids if "dialect" not in name))
        self.speakers = tuple(sorted(self.speaker_ids))
        self.default_speaker = None
        if self.tts_model_type == "custom_voice" and self.speakers:
            self.default_speaker = DEFAULT_VOICE if DEFAULT_VOICE in self.speaker_ids else self.speakers[0]
        self.talker = model.talker
        self.num_code_groups = self.talker.config.num_code_groups
        self.max_positions = self.talker.config.max_position_embeddings
        # fp32: a step's rows on omnimtp's row kernel (the 0.6B talker at one row 63 ms a frame step against 117 on
        # torch's matmul, at its floor, and 146 against 351 ms at 8 rows, 2-core AVX2), for a packed copy of its
        # matrices (+1.8 GB at 0.6B);
        # quantized: the quantized matrices instead (never packed for the row kernel, and each layer quantized as
        # it is packed, so the fused float copies never exist for more than one layer)
        if quantize is None:
            self.talker_decoder = PackedDecoder.from_module(self.talker.model).with_row_kernel()
        else:
            self.talker_decoder = PackedDecoder.from_module(self.talker.model, quantize=quantize,
                                                            stored=stored.get(self.decoder_paths[0]))
        self._predictors: dict[int, CodePredictorRunner] = {}
        # quantized: the code predictor's weights packed and quantized once and shared by every runner, so no
        # runner needs the model's float matrices again (`Qwen3TTSModel.release_decoder_linears`)
        self._predictor_weights = None
        if quantize is not None:
            cp = self.talker.code_predictor
            with torch.no_grad():
                weights = pack_predictor_weights(cp, next(cp.parameters()).dtype, quantize=quantize,
                                                 stored=stored.get(self.decoder_paths[1]))
            self._predictor_weights = weights.quantized(quantize)
        # quantized: the text projection's two matrices in int8 (either mode), on the kernel that computes every row
        # on its own, so a call projects all of a text's trailing rows and each row's bits stay its own
        self._text_projection = None
        if quantize is not None:
            mlp = self.talker.text_projection
            self._text_projection = tuple(
                (quantize_weight(fc.weight.detach().float(), "int8"), fc.bias.detach())
                for fc in (mlp.linear_fc1, mlp.linear_fc2)
            )
        self.special_ids = {
            name: config[f"{name}_token_id"] for name in ("im_start", "im_end", "tts_pad", "tts_bos", "tts_eos")
        }
        with torch.no_grad():
            specials = torch.tensor(
                [[self.special_ids["tts_bos"], self.special_ids["tts_eos"], self.special_ids["tts_pad"]]],
                device=self.device,
            )
            bos, eos, pad = self._text_rows(specials)[0].unbind(0)  # one projection over the three, as the reference
        self.tts_bos_embed, self.tts_eos_embed, self.tts_pad_embed = bos, eos, pad

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, codec_dtype: str | None = None,
                        quantized=None, **kwargs) -> Qwen3TTSFamily:
        """A checkpoint in the released layout: config.json + model.safetensors, the text tokenizer when its
        files are there (without them requests come as input_ids), and speech_tokenizer/ (only its decoder
        is read, and a Base model's encoder when the tokenizer has its weights: without them a Base model
        clones from the x-vector alone). codec_dtype: the decoder's conv stack in "float32" (None) or
        "bfloat16" (`omnimtp.codec.streaming.CODEC_DTYPES`, `SpeechTokenizerDecoder.to_conv_dtype`). quantized:
        the checkpoint at `path` loaded by `omnimtp.quantized_checkpoint.load_quantized_model` when it is a quantized
        one (`OmniPipeline.from_pretrained` does it): its model and stored matrices, in its mode."""
        from transformers import AutoTokenizer

        from omnimtp.runtime.device import resolve_device

        conv_dtype = codec_dtype_of(codec_dtype)
        path = os.fspath(path)
        is_quantized = quantized is not None
        if is_quantized:
            if device is not None and resolve_device(device).type != "cpu":
                raise ValueError(f"device: {path!r} is a quantized checkpoint; its kernels run on the CPU only")
            if kwargs.get("quantize") not in (None, quantized.mode):
                raise ValueError(f"quantize={kwargs['quantize']!r}: {path!r} holds {quantized.mode!r} weights "
                                 "(quantize with `omnimtp quantize` again from the float checkpoint for another mode)")
            model = quantized.model
            kwargs.update(quantize=quantized.mode, stored=quantized.stored)
        else:
            model = Qwen3TTSModel.from_pretrained(path, dtype=dtype)
        if device is not None and not is_quantized:
            model = model.to(resolve_device(device))
            model._restore_rope()
        has_tokenizer = any(
            os.path.isfile(os.path.join(path, name))
            for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
        )
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
        codec_path = os.path.join(path, "speech_tokenizer")
        if not os.path.isdir(codec_path):
            raise ValueError(f"path: {path!r} has no speech_tokenizer/ (a Qwen3-TTS checkpoint keeps its codec there)")
        codec = SpeechTokenizerDecoder.from_pretrained(codec_path, device=model.talker.device).to_conv_dtype(conv_dtype)
        speech_encoder = None
        if model.speaker_encoder is not None:
            speech_encoder = SpeechTokenizerEncoder.from_pretrained(codec_path, device=model.talker.device)
        if kwargs.get("quantize") is not None and not is_quantized:  # so that releasing the float matrices
            model.copy_other_weights()  # unmaps the weights file
        return cls(model, tokenizer, codec=codec, speech_encoder=speech_encoder, **kwargs)._owning_model()

    @classmethod
    def tiny(cls, seed: int = 0, tts_model_type: str = "custom_voice", device=None, codec_dtype: str | None = None,
             **kwargs) -> Qwen3TTSFamily:
        """A seeded tiny Qwen3-TTS (`omnimtp.models.qwen3_tts.tiny_qwen3_tts`) with the byte-level tokenizer and
        a seeded tiny speech tokenizer decoder (`tiny_speech_tokenizer`: audible on random codes); a Base model
        also gets a seeded tiny tokenizer encoder (`tiny_speech_tokenizer_encoder`). codec_dtype: as in
        `from_pretrained`."""
        from omnimtp.models.qwen3_tts import tiny_qwen3_tts
        from omnimtp.runtime.device import one_thread, resolve_device
        from omnimtp.tokenizer import byte_tokenizer

        conv_dtype = codec_dtype_of(codec_dtype)
        with one_thread():
            model, codec = tiny_qwen3_tts(seed, tts_model_type), tiny_speech_tokenizer(seed).to_conv_dtype(conv_dtype)
            speech_encoder = tiny_speech_tokenizer_encoder(seed) if tts_model_type == "base" else None
            if device is not None:
                model, codec = model.to(resolve_device(device)), codec.to(resolve_device(device))
                speech_encoder = None if speech_encoder is None else speech_encoder.to(resolve_device(device))
                model._restore_rope()
            family = cls(model, byte_tokenizer(), codec=codec, speech_encoder=speech_encoder, **kwargs)
            return family._owning_model()

    def _owning_model(self) -> Qwen3TTSFamily:
        """This family, for a model it made itself: quantized, the float matrices its quantized copies replace
        are released from the model (`Qwen3TTSModel.release_decoder_linears`), so quantizing saves memory. A
        model the caller passed is left as it is."""
        if self.quantize is not None:
            self.model.release_decoder_linears()
        return self

    @property
    def device(self) -> torch.device:
        return self.talker.device

    # --- the request: text, voice, language, instructions ---

    def speech_ids(self, text: str) -> list[int]:
        """The assistant-text template around `text` (what the reference's processor gives)."""
        if self.tokenizer is None:
            raise ValueError("text: this checkpoint has no text tokenizer; pass input_ids")
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string (or a list of strings), got {type(text).__name__}")
        if not text.strip():
            raise ValueError("text: empty text")
        return list(self.tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n",
                                          add_special_tokens=False))

    def check_speech_ids(self, ids: list[int]) -> None:
        """ValueError naming input_ids unless they are an assistant-text template with at least one text token."""
        im_start, im_end = self.special_ids["im_start"], self.special_ids["im_end"]
        if (len(ids) < NUM_TEMPLATE_HEAD + NUM_TEMPLATE_TAIL + 1 or ids[0] != im_start
                or ids[-NUM_TEMPLATE_TAIL] != im_end or ids[-3] != im_start):
            raise ValueError("input_ids: expected '<|im_start|>assistant\\n{text}<|im_end|>\\n"
                             "<|im_start|>assistant\\n' ids with a non-empty text")

    def talker_positions(self, ids: list[int], voice: TTSVoice, max_frames: int) -> int:
        """The talker positions a request of `speech_ids` ids in `voice` may take: its prompt rows (the
        instructions, the text, an in-context clone's reference rows and eight rows of structure) and up to
        max_frames frames; at most `max_positions`."""
        return len(ids) + len(voice.instruct_ids or ()) + voice.num_reference_rows + 8 + max_frames

    def num_speech_template_ids(self) -> int:
        return NUM_TEMPLATE_HEAD + NUM_TEMPLATE_TAIL

    def speech_window(self, voice: TTSVoice, max_frames: int) -> int:
        """The most `speech_ids` a segment in `voice` may have: `talker_positions` with max_frames frames
        within `max_positions`."""
        return self.max_positions - self.talker_positions([], voice, max_frames)

    def voice(self, voice=None, language: str | None = None, instructions: str | None = None) -> TTSVoice:
        """The request's `TTSVoice`; ValueError naming voice, language or instructions when the model cannot
        speak that way (an unknown voice or language lists the known ones). voice: a CustomVoice speaker
        name; on a Base model a cloned `omnimtp.voice.Voice` (checked by `check_clone`), or None: no speaker
        row (the reference's request without a voice-clone prompt)."""
        if isinstance(voice, Voice):
            self.check_clone(voice)
            return TTSVoice(language_id=self._language_id(language, None),
                            instruct_ids=self._instruct_ids(instructions), clone=voice)
        speaker = speaker_id = None
        if self.tts_model_type == "base" and voice is not None:
            raise ValueError(f"voice: a Base model speaks cloned voices (an omnimtp.voice.Voice from create_voice), "
                             f"not {voice!r}")
        if self.tts_model_type == "custom_voice":
            name = self.default_speaker if voice is None else voice
            if not isinstance(name, str) or match_speaker(self.speakers, name) is None:
                raise ValueError(f"voice: unknown voice {name!r}; voices: {list(self.speakers)}")
            speaker = match_speaker(self.speakers, name)
            speaker_id = self.speaker_ids[speaker]
        elif voice is not None:
            raise ValueError("voice: a VoiceDesign model has no named voices; describe the voice in instructions")
        language_id = self._language_id(language, speaker)
        instruct_ids = self._instruct_ids(instructions)
        return TTSVoice(speaker, speaker_id, language_id, instruct_ids)

    # --- voice cloning (Base) ---

    def create_voice(self, ref_audio=None, ref_text: str | None = None, *, x_vector_only: bool = False,
                     speaker_embedding=None, ref_codes=None, ref_text_ids=None,
                     min_seconds: float = MIN_REF_AUDIO_SECONDS, max_seconds: float = MAX_REF_AUDIO_SECONDS) -> Voice:
        """A cloned `Voice` of a Base model, computed once (the reference's `create_voice_clone_prompt`).

        ref_audio: the reference recording, a file path (any format libsndfile reads) or a (samples,
        sample_rate) pair of mono float samples; decoded and resampled to 24 kHz with `omnimtp.media`, between
        min_seconds and max_seconds long. Its x-vector is the voice's speaker embedding; with a transcript
        (ref_text, or its ids ref_text_ids: the ids between `<|im_start|>assistant\n` and `<|im_end|>\n` of the
        template) and x_vector_only False, its 12 Hz codes and the transcript make the voice in-context (ICL);
        otherwise it is the x-vector alone. Precomputed parts (speaker_embedding [D], ref_codes
        [num_code_groups, T], ref_text_ids [N]) replace what would be computed from ref_audio, and are checked
        against the model. ValueError naming the argument for anything this model cannot use."""
        from omnimtp.media import load_audio

        given = "ref_audio" if ref_audio is not None else "speaker_embedding"
        if self.tts_model_type != "base":
            raise ValueError(
                f"{given}: voice cloning needs a Qwen3-TTS Base model; this is a {self.tts_model_type} model"
            )
        if not isinstance(x_vector_only, bool):
            raise ValueError(f"x_vector_only: expected a bool, got {type(x_vector_only).__name__}")
        if ref_text is not None and (not isinstance(ref_text, str) or not ref_text.strip()):
            raise ValueError("ref_text: expected a non-empty transcript string or None")
        samples, seconds = None, 0.0
        if ref_audio is not None:
            samples = load_audio(ref_audio, SAMPLE_RATE, MediaLimits(max_audio_seconds=max_seconds), param="ref_audio")
            seconds = len(samples) / SAMPLE_RATE  # load_audio refused non-finite and too loud samples
            if seconds < min_seconds:
                raise ValueError(
                    f"ref_audio: {seconds:.2f} s of audio is shorter than the minimum of {min_seconds:g} s"
                )
        elif speaker_embedding is None:
            raise ValueError("ref_audio: give a reference recording (or a precomputed speaker_embedding)")
        if speaker_embedding is None:
            speaker_embedding = self.model.speaker_encoder.embed(samples)
        is_icl = not x_vector_only and (ref_text is not None or ref_text_ids is not None)
        if not x_vector_only and ref_codes is not None and not is_icl:
            raise ValueError("ref_text: in-context cloning with ref_codes needs ref_text or ref_text_ids")
        if is_icl:
            if ref_text_ids is None:
                if self.tokenizer is None:
                    raise ValueError("ref_text: this checkpoint has no text tokenizer; pass ref_text_ids")
                ids = self.tokenizer.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n", add_special_tokens=False)
                ref_text_ids = torch.tensor(ids[NUM_TEMPLATE_HEAD:-2])
            if ref_codes is None:
                if samples is None:
                    raise ValueError("ref_codes: in-context cloning needs ref_audio or precomputed ref_codes")
                if self.speech_encoder is None:
                    raise ValueError("ref_text: this checkpoint's speech tokenizer has no encoder weights for "
                                     "in-context cloning; pass x_vector_only=True or precomputed ref_codes")
                ref_codes = self.speech_encoder.encode(samples)
        else:
            ref_codes = ref_text_ids = None
        voice = Voice(speaker_embedding, ref_codes, ref_text_ids, ref_text=ref_text if is_icl else None,
                      seconds=seconds,
                      info={"model_type": self.model_type, "tts_model_size": str(self.tts_model_size)})
        self.check_clone(voice, prefix="")
        return voice

    def check_clone(self, voice: Voice, prefix: str = "voice.") -> None:
        """ValueError unless this is a Base model and `voice` fits it: an x-vector of the talker's width,
        reference codes [num_code_groups, T] in the codebook, transcript ids in the text vocabulary. The error
        names the part, after `prefix` ("voice.speaker_embedding: ...")."""
        if self.tts_model_type != "base":
            raise ValueError(
                f"voice: voice cloning needs a Qwen3-TTS Base model; this is a {self.tts_model_type} model"
            )
        hidden_size = self.talker.config.hidden_size
        if voice.speaker_embedding.shape != (hidden_size,):
            raise ValueError(f"{prefix}speaker_embedding: has {voice.speaker_embedding.shape[0]} values; this model's "
                             f"x-vector has {hidden_size}")
        if voice.ref_codes is not None:
            codebook_size = self.talker.code_predictor.config.vocab_size
            if voice.ref_codes.shape[0] != self.num_code_groups:
                raise ValueError(f"{prefix}ref_codes: has {voice.ref_codes.shape[0]} code groups; this model has "
                                 f"{self.num_code_groups}")
            if int(voice.ref_codes.max()) >= codebook_size:
                raise ValueError(f"{prefix}ref_codes: holds code {int(voice.ref_codes.max())}, outside the codebook "
                                 f"[0, {codebook_size})")
            text_vocab_size = self.talker.model.text_embedding.num_embeddings
            if int(voice.ref_text_ids.max()) >= text_vocab_size:
                raise ValueError(f"{prefix}ref_text_ids: holds id {int(voice.ref_text_ids.max())}, outside the text "
                                 f"vocabulary [0, {text_vocab_size})")

    def _language_id(self, language: str | None, speaker: str | None) -> int | None:
        if language is not None and not isinstance(language, str):
            raise ValueError(f"language: expected a string or None, got {type(language).__name__}")
        key = AUTO_LANGUAGE if language is None else language.strip().lower()
        if key != AUTO_LANGUAGE and key not in self.languages:
            raise ValueError(f"language: unknown language {language!r}; languages: {[AUTO_LANGUAGE, *self.languages]}")
        dialect = self.speaker_dialects.get(speaker, False) if speaker is not None else False
        if dialect and key in (AUTO_LANGUAGE, "chinese"):
            return self.language_ids[dialect]  # a dialect speaker speaks Chinese in its dialect
        return None if key == AUTO_LANGUAGE else self.language_ids[key]

    @property
    def takes_instructions(self) -> bool:
        """Whether the model reads `instructions`: VoiceDesign (the voice, required) and CustomVoice 1.7B (the
        style); CustomVoice 0.6B and Base ignore them, so a request giving them is refused."""
        return self.tts_model_type == "voice_design" or (
            self.tts_model_type == "custom_voice" and self.tts_model_size != "0b6"
        )

    def _instruct_ids(self, instructions: str | None) -> tuple[int, ...] | None:
        takes_instructions = self.takes_instructions
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError(f"instructions: expected a string or None, got {type(instructions).__name__}")
        given = instructions is not None and instructions.strip() != ""
        if self.tts_model_type == "voice_design" and not given:
            raise ValueError("instructions: a VoiceDesign model needs instructions describing the voice")
        if not given:
            return None
        if not takes_instructions:
            raise ValueError(
                f"instructions: this {self.tts_model_type} {self.tts_model_size} model ignores instructions"
            )
        if self.tokenizer is None:
            raise ValueError("instructions: this checkpoint has no text tokenizer to read instructions")
        return tuple(self.tokenizer.encode(f"<|im_start|>user\n{instructions}<|im_end|>\n", add_special_tokens=False))

    def check_speaker(self, speaker) -> None:
        if not isinstance(speaker, TTSVoice):
            raise ValueError(f"speaker: a Qwen3-TTS request speaks a TTSVoice, got {type(speaker).__name__}")

    # --- a model without chat ---

    def _no_chat(self, *args, **kwargs):
        raise ValueError("prompt: a Qwen3-TTS model has no chat; it speaks text (OmniPipeline.speech)")

    check_media = new_thinker = talker_builder = reply_talker_inputs = chat_inputs = chat_ids = _no_chat

    # --- text → talker inputs ---

    def _text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """T(ids): [1, n] → [1, n, H], one projection call (float: its rows' bits depend on the call's shape;
        quantized: each row's are its own)."""
        embeds = self.talker.model.text_embedding(ids)
        if self._text_projection is None:
            return self.talker.text_projection(embeds)
        (fc1, bias1), (fc2, bias2) = self._text_projection
        hidden = linear(embeds, None, bias1, packed=fc1)  # [1, n, I]
        # SiLU a row at a time: torch's vectorized elementwise loop leaves a tail past its last full block of
        # vectors to the scalar exp, so a row's bits would depend on where it sits in a larger tensor (AVX-512:
        # blocks of 32 floats)
        hidden = torch.stack([torch.nn.functional.silu(row) for row in hidden.unbind(1)], dim=1)
        return linear(hidden, None, bias2, packed=fc2)

    def _codec_rows(self, ids: list[int]) -> torch.Tensor:
        return self.talker.get_input_embeddings()(torch.tensor([ids], device=self.device))  # [1, n, H]

    @torch.no_grad()
    def speech_talker_inputs(self, ids: list[int], voice: TTSVoice) -> TalkerInputs:
        """The talker inputs that speak the template ids `ids` in `voice` (see the module docstring)."""
        self.check_speaker(voice)
        config = self.talker.config
        input_ids = torch.tensor([ids], device=self.device)  # [1, P]
        if voice.language_id is None:
            think = [config.codec_nothink_id, config.codec_think_bos_id, config.codec_think_eos_id]
        else:
            think = [config.codec_think_id, config.codec_think_bos_id, voice.language_id, config.codec_think_eos_id]
        codec = [self._codec_rows(think)]
        if voice.speaker_id is not None:
            codec.append(
                self.talker.get_input_embeddings()(torch.tensor(voice.speaker_id, device=self.device)).view(1, 1, -1)
            )
        elif voice.clone is not None:  # the x-vector is the speaker row
            codec.append(voice.clone.speaker_embedding.to(self.device, self.talker.dtype).view(1, 1, -1))
        codec.append(self._codec_rows([config.codec_pad_id, config.codec_bos_id]))
        codec = torch.cat(codec, dim=1)  # [1, n, H]
        pad, bos, eos = (row.view(1, 1, -1) for row in (self.tts_pad_embed, self.tts_bos_embed, self.tts_eos_embed))
        rows = [] if voice.instruct_ids is None else [
            self._text_rows(torch.tensor([voice.instruct_ids], device=self.device))
        ]
        rows.append(self._text_rows(input_ids[:, :NUM_TEMPLATE_HEAD]))
        rows.append(torch.cat([pad.expand(-1, codec.shape[1] - 2, -1), bos], dim=1) + codec[:, :-1])
        text = input_ids[:, NUM_TEMPLATE_HEAD:-NUM_TEMPLATE_TAIL]
        if voice.clone is not None and voice.clone.ref_codes is not None:
            rows_icl, trailing = self._icl_rows(text, voice.clone)
            rows.append(rows_icl)
        elif self.non_streaming_mode:
            text_rows = torch.cat([self._text_rows(text), eos], dim=1)
            rows.append(text_rows + self._codec_rows([config.codec_pad_id] * text_rows.shape[1]))
            rows.append(pad + self._codec_rows([config.codec_bos_id]))
            trailing = pad[0, :0]
        else:
            rows.append(self._text_rows(text[:, :1]) + codec[:, -1:])
            trailing = torch.cat([self.speech_text_rows(text[0, 1:].tolist()), eos[0]])
        prefill = torch.cat(rows, dim=1)[0]  # [L, H]
        prefill_ids = torch.full((prefill.shape[0],), self.special_ids["tts_pad"], dtype=torch.long, device=self.device)
        return TalkerInputs(prefill, prefill_ids, trailing, self.tts_pad_embed)

    def _icl_rows(self, text: torch.Tensor, clone: Voice) -> tuple[torch.Tensor, torch.Tensor]:
        """The in-context prompt (the reference's `generate_icl_prompt`): text [1, n] → (prefill rows [1, L, H],
        trailing rows [m, H]). Text rows T(transcript ++ text) ++ T(tts_eos) are summed with the codec rows
        C(bos) ++ the summed code embeddings of each reference frame; streaming, they pair up one to one (the
        longer side's surplus becomes trailing text, or T(tts_pad) rows fill the text side); non-streaming,
        all the text rows come first (each + C(pad)), then the codec rows (each + T(tts_pad))."""
        config = self.talker.config
        pad, eos = self.tts_pad_embed.view(1, 1, -1), self.tts_eos_embed.view(1, 1, -1)
        ref_text_ids = clone.ref_text_ids.to(self.device)[None]  # [1, N]
        text_rows = torch.cat(
            [self._text_rows(torch.cat([ref_text_ids, text], dim=-1)), eos], dim=1
        )  # [1, N + n + 1, H]
        codes = clone.ref_codes.to(self.device).T  # [T, G]
        tables = [self.talker.get_input_embeddings(), *self.talker.code_predictor.model.codec_embedding]
        frames = torch.cat([table(codes[:, g:g + 1]) for g, table in enumerate(tables)], dim=1).sum(1)  # [T, H]
        codec_rows = torch.cat([self._codec_rows([config.codec_bos_id]), frames[None]], dim=1)  # [1, T + 1, H]
        num_text, num_codec = text_rows.shape[1], codec_rows.shape[1]
        if self.non_streaming_mode:
            prefill = torch.cat(
                [text_rows + self._codec_rows([config.codec_pad_id] * num_text), codec_rows + pad], dim=1
            )
            return prefill, pad[0, :0]
        if num_text > num_codec:
            return text_rows[:, :num_codec] + codec_rows, text_rows[0, num_codec:]
        text_rows = torch.cat([text_rows, pad.expand(-1, num_codec - num_text, -1)], dim=1)
        return text_rows + codec_rows, pad[0, :0]

    @torch.no_grad()
    def speech_text_rows(self, ids: list[int]) -> torch.Tensor:
        """The trailing text rows [n, H]: T(id) of each id on its own, so a row's bits do not depend on how
        many rows there are and text that arrives in pieces gets the same rows (the reference projects them in
        one call: within float rounding, the same greedy codes). Float: a call per id, each reading the
        projection's 25 MB at the 0.6B widths (57 ms for a 56-token text, before the first audio); quantized: one
        call for all, whose kernel computes each row on its own."""
        if not ids:
            return self.tts_pad_embed.new_zeros(0, self.tts_pad_embed.shape[0])
        if self._text_projection is not None:
            return self._text_rows(torch.tensor([ids], device=self.device))[0]
        return torch.cat([self._text_rows(torch.tensor([[token]], device=self.device))[0] for token in ids])

    def speech_stream(self, voice: TTSVoice) -> SpeechTextStream:
        """The talker inputs of text whose ids arrive in pieces (`omnimtp.handoff.SpeechTextStream`): the
        streaming-text layout's prefill needs the template's head and the first text id; non_streaming_mode
        and an in-context clone (its prefill pairs the transcript and the text with the reference's frames) put
        the whole text in the prefill, so they wait for all of it."""
        self.check_speaker(voice)
        is_icl = voice.clone is not None and voice.clone.ref_codes is not None
        num_prefill_ids = None if self.non_streaming_mode or is_icl else NUM_TEMPLATE_HEAD + 1
        return SpeechTextStream(lambda ids: self.speech_talker_inputs(ids, voice), self.speech_text_rows,
                                num_prefill_ids, self._template_tail_ids())

    def speech_text_ids(self) -> StreamedTextIds:
        """The ids of text that arrives in pieces: joined, `speech_ids` of the whole text."""
        if self.tokenizer is None:
            raise ValueError("text: this checkpoint has no text tokenizer; pass input_ids")
        return StreamedTextIds(self.tokenizer.backend_tokenizer, head=TEMPLATE_HEAD, tail=TEMPLATE_TAIL)

    def _template_tail_ids(self) -> list[int]:
        if self.tokenizer is None:
            return []  # input_ids come whole
        return list(self.tokenizer.encode(TEMPLATE_TAIL, add_special_tokens=False))

    # --- talker ---

    def predictor(self, max_batch_size: int) -> CodePredictorRunner:
        """The code predictor runner for batches up to max_batch_size, made once per size."""
        if max_batch_size not in self._predictors:
            self._predictors[max_batch_size] = CodePredictorRunner(
                self.talker.code_predictor, max_batch_size, compile=self.compile_predictor, quantize=self.quantize,
                weights=self._predictor_weights,
            )
        return self._predictors[max_batch_size]

    def warm_up(self, max_batch_size: int, on_bucket=None, stop=None, **options) -> bool:
        """Build the compiled predictor's graphs for every batch bucket up to max_batch_size, greedy and sampled
        as `default_sampling` samples it (the talker's settings without the repetition penalty;
        `CodePredictorRunner.warm_up`, whose keywords `options` are). Returns whether every bucket is warm
        (False for an eager predictor)."""
        sampling = replace(QWEN3_TTS_SAMPLING, repetition_penalty=1.0)
        return self.predictor(max_batch_size).warm_up(on_bucket, stop, sampling=sampling, **options)

    def new_talker_batch(self, max_batch_size: int) -> TalkerBatch:
        frames = Qwen3FrameMaker(
            self.talker, max_batch_size, self.predictor(max_batch_size), vocab_size=self.talker.config.vocab_size,
            greedy=QWEN3_TTS_TALKER_GREEDY, predictor_sampling=None, min_new_tokens=MIN_NEW_TOKENS,
        )
        return TalkerBatch(self.talker, max_batch_size, decoder=self.talker_decoder, frames=frames)

    # --- codec ---

    def new_codec_stream(self, speaker, generator: torch.Generator | None):
        """The speech tokenizer decoder's stream state (it has neither speaker nor noise); None without a codec.
        An in-context clone's stream has decoded the reference codes first: the reference decodes reference
        codes ++ generated codes and cuts the reference's share of the audio, which is the generated codes
        decoded with the reference as their left context."""
        if self.codec is None:
            return None
        stream = self.codec.new_stream()
        clone = getattr(speaker, "clone", None)
        if clone is not None and clone.ref_codes is not None:
            self.codec.decode_streams([stream], [clone.ref_codes], [False])
        return stream

    def decode_audio(self, streams: list, blocks: list[torch.Tensor], is_final: list[bool]) -> list[np.ndarray]:
        """The next audio of several requests in one decoder call (no audio without a codec)."""
        if self.codec is None:
            return [np.zeros(0, dtype=np.float32) for _ in blocks]
        chunks = self.codec.decode_streams(streams, blocks, is_final)
        return [np.asarray(chunk, dtype=np.float32) for chunk in chunks]

