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
    trailing text = T(the other text tokens), T(tts_eos)         one row per frame, then T(tts_pad)

`non_streaming_mode=True` (the reference's other layout) puts the whole text in the prefill instead:
... T(tts_pad)s + C(rows[:-1]), then T(text) ++ T(tts_eos) + C(pad) each, then T(tts_pad) + C(bos); no
trailing text. The projections are made in the reference's calls (the same row groups), so the prefill is
bit for bit the reference's.

    family = Qwen3TTSFamily.from_pretrained(path)       # or Qwen3TTSFamily.tiny()
    core = EngineCore(family, EngineConfig())
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder, tiny_speech_tokenizer
from omnimtp.families.text import ChatText, match_speaker
from omnimtp.handoff import TalkerInputs
from omnimtp.models.qwen3_tts import Qwen3TTSModel
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.sampling import SamplingParams
from omnimtp.talker.code_predictor import CodePredictorRunner
from omnimtp.talker.loop import Qwen3FrameMaker, TalkerBatch

SAMPLE_RATE = 24_000
# Qwen3-TTS's `generate` defaults: greedy keeps the repetition penalty; sampled, the talker and (without the
# penalty) the code predictor use T 0.9, top-k 50, top-p 1.0.
QWEN3_TTS_TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.05)
QWEN3_TTS_SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
MIN_NEW_TOKENS = 2  # talker tokens before codec EOS may be sampled (the reference's min_new_tokens)
NUM_TEMPLATE_HEAD = 3  # <|im_start|> assistant \n
NUM_TEMPLATE_TAIL = 5  # <|im_end|> \n <|im_start|> assistant \n
AUTO_LANGUAGE = "auto"
DEFAULT_VOICE = "vivian"


@dataclass(frozen=True)
class TTSVoice:
    """A speech request's voice, resolved against the model: speaker (a CustomVoice speaker id, the
    config's lower-case name) or None, language_id (the codec language row) or None (auto), instruct_ids
    (the user turn of the instructions) or None."""

    speaker: str | None = None
    speaker_id: int | None = None
    language_id: int | None = None
    instruct_ids: tuple[int, ...] | None = None


class Qwen3TTSFamily(ChatText):
    """Qwen3-TTS's side of the engine (see the module docstring).

    model: `omnimtp.models.qwen3_tts.Qwen3TTSModel`; tokenizer: its text tokenizer, or None (then requests
    come as input_ids of the assistant-text template and no instructions are taken as text). codec: the
    12 Hz speech tokenizer's decoder (`omnimtp.codec.speech_tokenizer.SpeechTokenizerDecoder`), or None: codes
    only (every output's audio is empty). non_streaming_mode: the reference's other prompt layout (the whole text in the
    prefill). compile_predictor: `CodePredictorRunner`'s compile mode."""

    model_type = "qwen3_tts"  # the checkpoint's config.json model_type
    sample_rate = SAMPLE_RATE
    has_chat = False
    default_sampling = QWEN3_TTS_SAMPLING  # a sampled request's settings where it gives none (the reference's)

    def __init__(self, model: Qwen3TTSModel, tokenizer=None, *, codec=None, non_streaming_mode: bool = False,
                 compile_predictor: bool | str = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.codec = codec
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
        self.talker_decoder = PackedDecoder.from_module(self.talker.model)
        self._predictors: dict[int, CodePredictorRunner] = {}
        self.special_ids = {name: config[f"{name}_token_id"] for name in ("im_start", "im_end", "tts_pad", "tts_bos", "tts_eos")}
        with torch.no_grad():
            specials = torch.tensor([[self.special_ids["tts_bos"], self.special_ids["tts_eos"], self.special_ids["tts_pad"]]],
                                    device=self.device)
            bos, eos, pad = self._text_rows(specials)[0].unbind(0)  # one projection over the three, as the reference
        self.tts_bos_embed, self.tts_eos_embed, self.tts_pad_embed = bos, eos, pad

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, **kwargs) -> "Qwen3TTSFamily":
        """A checkpoint in the released layout: config.json + model.safetensors, the text tokenizer when its
        files are there (without them requests come as input_ids), and speech_tokenizer/ (only its decoder
        is read: a tokenizer without encoder weights serves CustomVoice and VoiceDesign)."""
        from transformers import AutoTokenizer

        from omnimtp.runtime.device import resolve_device

        path = os.fspath(path)
        model = Qwen3TTSModel.from_pretrained(path, dtype=dtype)
        if device is not None:
            model = model.to(resolve_device(device))
            model._restore_rope()
        has_tokenizer = any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
        codec_path = os.path.join(path, "speech_tokenizer")
        if not os.path.isdir(codec_path):
            raise ValueError(f"path: {path!r} has no speech_tokenizer/ (a Qwen3-TTS checkpoint keeps its codec there)")
        codec = SpeechTokenizerDecoder.from_pretrained(codec_path, device=model.talker.device)
        return cls(model, tokenizer, codec=codec, **kwargs)

    @classmethod
    def tiny(cls, seed: int = 0, tts_model_type: str = "custom_voice", device=None, **kwargs) -> "Qwen3TTSFamily":
        """A seeded tiny Qwen3-TTS (`omnimtp.models.qwen3_tts.tiny_qwen3_tts`) with the byte-level tokenizer and
        a seeded tiny speech tokenizer decoder (`tiny_speech_tokenizer`: audible on random codes)."""
        from omnimtp.models.qwen3_tts import tiny_qwen3_tts
        from omnimtp.runtime.device import resolve_device
        from omnimtp.tokenizer import byte_tokenizer

        model, codec = tiny_qwen3_tts(seed, tts_model_type), tiny_speech_tokenizer(seed)
        if device is not None:
            model, codec = model.to(resolve_device(device)), codec.to(resolve_device(device))
            model._restore_rope()
        return cls(model, byte_tokenizer(), codec=codec, **kwargs)

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
        if (len(ids) < NUM_TEMPLATE_HEAD + NUM_TEMPLATE_TAIL + 1 or ids[0] != im_start or ids[-NUM_TEMPLATE_TAIL] != im_end
                or ids[-3] != im_start):
            raise ValueError("input_ids: expected '<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n' "
                             "ids with a non-empty text")

    def talker_positions(self, ids: list[int], voice: TTSVoice, max_frames: int) -> int:
        """The talker positions a request of `speech_ids` ids in `voice` may take: its prompt rows (the
        instructions, the text and eight rows of structure) and up to max_frames frames; at most
        `max_positions`."""
        return len(ids) + len(voice.instruct_ids or ()) + 8 + max_frames

    def voice(self, voice=None, language: str | None = None, instructions: str | None = None) -> TTSVoice:
        """The request's `TTSVoice`; ValueError naming voice, language or instructions when the model cannot
        speak that way (an unknown voice or language lists the known ones)."""
        if self.tts_model_type == "base":
            raise ValueError("voice: a Base (voice-clone) model speaks cloned voices, which this engine does not serve yet")
        speaker = speaker_id = None
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

    def _instruct_ids(self, instructions: str | None) -> tuple[int, ...] | None:
        takes_instructions = self.tts_model_type == "voice_design" or (
            self.tts_model_type == "custom_voice" and self.tts_model_size != "0b6"
        )
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError(f"instructions: expected a string or None, got {type(instructions).__name__}")
        given = instructions is not None and instructions.strip() != ""
        if self.tts_model_type == "voice_design" and not given:
            raise ValueError("instructions: a VoiceDesign model needs instructions describing the voice")
        if not given:
            return None
        if not takes_instructions:
            raise ValueError(f"instructions: this {self.tts_model_type} {self.tts_model_size} model ignores instructions")
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
        """T(ids): [1, n] → [1, n, H], one projection call (its rows' bits depend on the call's shape)."""
        return self.talker.text_projection(self.talker.model.text_embedding(ids))

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
            codec.append(self.talker.get_input_embeddings()(torch.tensor(voice.speaker_id, device=self.device)).view(1, 1, -1))
        codec.append(self._codec_rows([config.codec_pad_id, config.codec_bos_id]))
        codec = torch.cat(codec, dim=1)  # [1, n, H]
        pad, bos, eos = (row.view(1, 1, -1) for row in (self.tts_pad_embed, self.tts_bos_embed, self.tts_eos_embed))
        rows = [] if voice.instruct_ids is None else [self._text_rows(torch.tensor([voice.instruct_ids], device=self.device))]
        rows.append(self._text_rows(input_ids[:, :NUM_TEMPLATE_HEAD]))
        rows.append(torch.cat([pad.expand(-1, codec.shape[1] - 2, -1), bos], dim=1) + codec[:, :-1])
        text = input_ids[:, NUM_TEMPLATE_HEAD:-NUM_TEMPLATE_TAIL]
        if self.non_streaming_mode:
            text_rows = torch.cat([self._text_rows(text), eos], dim=1)
            rows.append(text_rows + self._codec_rows([config.codec_pad_id] * text_rows.shape[1]))
            rows.append(pad + self._codec_rows([config.codec_bos_id]))
            trailing = pad[0, :0]
        else:
            rows.append(self._text_rows(text[:, :1]) + codec[:, -1:])
            trailing = torch.cat([self._text_rows(text[:, 1:]), eos], dim=1)[0]
        prefill = torch.cat(rows, dim=1)[0]  # [L, H]
        prefill_ids = torch.full((prefill.shape[0],), self.special_ids["tts_pad"], dtype=torch.long, device=self.device)
        return TalkerInputs(prefill, prefill_ids, trailing, self.tts_pad_embed)

    # --- talker ---

    def predictor(self, max_batch_size: int) -> CodePredictorRunner:
        """The code predictor runner for batches up to max_batch_size, made once per size."""
        if max_batch_size not in self._predictors:
            self._predictors[max_batch_size] = CodePredictorRunner(
                self.talker.code_predictor, max_batch_size, compile=self.compile_predictor
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
        """The speech tokenizer decoder's stream state (it has neither speaker nor noise); None without a codec."""
        return None if self.codec is None else self.codec.new_stream()

    def decode_audio(self, streams: list, blocks: list[torch.Tensor], is_final: list[bool]) -> list[np.ndarray]:
        """The next audio of several requests in one decoder call (no audio without a codec)."""
        if self.codec is None:
            return [np.zeros(0, dtype=np.float32) for _ in blocks]
        chunks = self.codec.decode_streams(streams, blocks, is_final)
        return [np.asarray(chunk, dtype=np.float32) for chunk in chunks]

