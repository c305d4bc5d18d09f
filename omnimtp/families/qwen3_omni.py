"""Qwen3-Omni behind the engine's family interface: ids, the thinker run, the talker inputs, the talker
batch, the code predictor and code2wav.

The engine core (`omnimtp.engine.core`) knows nothing about Qwen3-Omni; everything model-specific it
needs goes through the methods below. The weights are packed once here (thinker and talker decoders,
code predictor) and shared by every run, batch and driver.

    family = Qwen3OmniFamily(model, tokenizer)          # or Qwen3OmniFamily.tiny()
    core = EngineCore(family, EngineConfig())
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnimtp.codec.streaming import StreamingCode2Wav, codec_dtype_of
from omnimtp.families.placeholders import check_placeholders, split_media
from omnimtp.families.text import ChatText, speech_header_ids
from omnimtp.handoff import SpeechTextStream, TalkerInputs
from omnimtp.media import MediaInputs
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.runtime.decoder import ROUTED_EXPERT_FIELDS
from omnimtp.runtime.ops import check_quantize
from omnimtp.runtime.prefetch import reachable_tensors
from omnimtp.sampling import SamplingParams
from omnimtp.spec_decode.adaptive import DraftCostTable
from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
from omnimtp.talker.code_predictor import CodePredictorRunner
from omnimtp.talker.loop import QWEN3_OMNI_TALKER_SAMPLING, TalkerBatch
from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder, lookup_speaker, trimmed_thinker_rows
from omnimtp.thinker import PrefixRows, ThinkerRun, calibrate_thinker_cost_table

SAMPLE_RATE = 24_000


class Qwen3OmniFamily(ChatText):
    """Qwen3-Omni's side of the engine.

    model: transformers' `Qwen3OmniMoeForConditionalGeneration`; tokenizer: its text tokenizer, or None
    (then requests come as token ids and no text is decoded). processor: its audio and image processor
    (`omnimtp.media.load_processor`), or None when the checkpoint has none (then chat media is refused).
    compile_predictor: `CodePredictorRunner`'s compile mode (False, "auto", "step" or "frame"); worth it for a
    long-lived process, see `warm_up`. thinker_speculation: the thinker's speculative steps
    (`omnimtp.spec_decode.thinker_spec.ThinkerSpeculation`), or None for one token per step. quantize: the
    thinker's and talker's linears (`OmniPipeline`'s). codec_dtype: code2wav's conv stack in "float32" or
    "bfloat16" (`omnimtp.codec.streaming.CODEC_DTYPES`), on a copy of the stack where the model's is in another
    dtype (the model's own code2wav is left as it is); None: in the model's dtype. stored: a quantized checkpoint's
    layers (`omnimtp.quantized_checkpoint`: per path of `decoder_paths`, each layer's quantized matrices; the
    model's float weights they replace are placeholders without data), with quantize its mode."""

    model_type = "qwen3_omni_moe"  # the checkpoint's config.json model_type
    decoder_paths = ("thinker.model.language_model", "talker.model")  # the packed (and quantized) decoders
    sample_rate = SAMPLE_RATE
    codec_looks_ahead = False  # code2wav looks at no later frame

    def __init__(self, model, tokenizer=None, *, processor=None, compile_predictor: bool | str = False,
                 thinker_speculation: ThinkerSpeculation | None = None, quantize: str | None = None,
                 codec_dtype: str | None = None, stored: dict | None = None):
        check_quantize(quantize, model.thinker.device)
        conv_dtype = None if codec_dtype is None else codec_dtype_of(codec_dtype)  # None: as the model's is
        self.quantize = quantize
        self.model = model.eval()
        self.thinker_speculation = thinker_speculation
        self.tokenizer = tokenizer
        self.processor = processor
        self.compile_predictor = compile_predictor
        config = model.config
        self.speakers = tuple(config.talker_config.speaker_id)
        lowered = {s.lower() for s in self.speakers}
        self.default_speaker = "ethan" if "ethan" in lowered else sorted(self.speakers)[0]
        self.accept_hidden_layer = config.talker_config.accept_hidden_layer
        self.num_code_groups = config.talker_config.num_code_groups
        self.max_positions = config.thinker_config.text_config.max_position_embeddings
        # The thinker stops on <|im_end|> (what transformers' generate is given) and on the tokenizer's EOS.
        self.eos_token_ids = {config.im_end_token_id}
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        # quantized: each layer quantized as it is packed, and never packed for the row kernel (`with_row_kernel`
        # leaves a quantized decoder as it is)
        thinker, talker = (PackedDecoder.from_module(model.get_submodule(path), quantize=quantize,
                                                     stored=(stored or {}).get(path)) for path in self.decoder_paths)
        if quantize is not None:  # its logits from an int8 head too (`PackedDecoder.with_quantized_lm_head`)
            thinker = thinker.with_quantized_lm_head(model.thinker.lm_head.weight)
        self.thinker_decoder, self.talker_decoder = thinker.with_row_kernel(), talker
        # another codec_dtype than the model's: code2wav's conv stack runs on a copy in it (the model's stays)
        self.codec = StreamingCode2Wav(model.code2wav, conv_dtype=conv_dtype)
        self._predictors: dict[int, CodePredictorRunner] = {}
        self.speech_header_ids = speech_header_ids(tokenizer)

    @classmethod
    def tiny(cls, seed: int = 0, device=None, **kwargs) -> Qwen3OmniFamily:
        """The embedded default: a seeded tiny Qwen3-Omni (random weights: noise-like, audible speech),
        its byte-level tokenizer and its processor, on `device` (default the CPU)."""
        from omnimtp.media import tiny_processor
        from omnimtp.models.tiny import tiny_qwen3_omni
        from omnimtp.runtime.device import one_thread, resolve_device
        from omnimtp.tokenizer import byte_tokenizer

        with one_thread():
            model = tiny_qwen3_omni(seed)
            if device is not None:
                model = model.to(resolve_device(device))
            tokenizer = byte_tokenizer()
            return cls(model, tokenizer, processor=tiny_processor(tokenizer, model.config.thinker_config), **kwargs)

    @property
    def device(self) -> torch.device:
        return self.thinker_decoder.device

    # --- ids and text: `omnimtp.families.text.ChatText` ---

    def check_speaker(self, speaker: str) -> None:
        lookup_speaker(self.model.config.talker_config.speaker_id, speaker)

    # --- media ---

    def check_media(self, prompt_ids: list[int], media: MediaInputs | None) -> None:
        """`omnimtp.families.placeholders.check_placeholders` with Qwen3-Omni's audio rows (transformers'
        `_get_feat_extract_output_lengths` of the feature frames)."""
        config = self.model.config.thinker_config
        check_placeholders(config, prompt_ids, media, lambda lengths: _audio_rows(lengths, config))

    def split_media(self, prompts: list[list[int]], media: MediaInputs | None) -> list[MediaInputs | None]:
        """`omnimtp.families.placeholders.split_media`: the batch's tensors per prompt."""
        return split_media(self.model.config.thinker_config, prompts, media)

    # --- thinker ---

    def new_thinker(self, prompts: list[list[int]], sampling: list[SamplingParams | None],
                    generators: list[torch.Generator], max_new_tokens: int,
                    media: list[MediaInputs | None] | None = None, prefill_block: int | None = None,
                    prefixes: list[PrefixRows | None] | None = None,
                    keeps_prefix: list[bool] | None = None, plain_start_steps: int = 0,
                    logprobs: list[int | None] | None = None) -> ThinkerRun:
        """One thinker run over `prompts` (one KV slot each), each row with its own sampling, generator
        and media (its encoders run in the row's prefill)."""
        return ThinkerRun(
            self.model.thinker, prompts, accept_hidden_layer=self.accept_hidden_layer,
            eos_token_ids=self.eos_token_ids, max_new_tokens=max_new_tokens, sampling=sampling,
            generators=generators, decoder=self.thinker_decoder, media=media, speculation=self.thinker_speculation,
            prefill_block=prefill_block, prefixes=prefixes, keeps_prefix=keeps_prefix,
            plain_start_steps=plain_start_steps, logprobs=logprobs,
        )

    def calibrate_speculation(self, max_batch_size: int) -> dict[str, DraftCostTable] | None:
        """With adaptive thinker speculation (`-k auto`) and no given costs: what a thinker step drafting
        k tokens costs at every batch-size bucket up to max_batch_size, greedy and sampled, measured now
        (once per thinker; the runs reuse it), or read back from an earlier start's measurement on disk
        (`omnimtp.spec_decode.cost_cache`) → {"greedy": table, "sampled": table}; else None. A server
        calls it at start-up, so no request waits for a measurement."""
        speculation = self.thinker_speculation
        if speculation is None or not speculation.is_adaptive or speculation.draft_costs is not None:
            return None
        return {
            name: calibrate_thinker_cost_table(self.model.thinker, self.thinker_decoder, speculation,
                                               self.accept_hidden_layer, max_batch_size, is_sampled,
                                               self.model.name_or_path)
            for name, is_sampled in (("greedy", False), ("sampled", True))
        }

    # --- thinker → talker ---

    def talker_builder(
        self, prompt_ids: list[int], speaker: str, media: MediaInputs | None = None, prefill_block: int | None = None
    ) -> Qwen3TalkerInputBuilder:
        """The request's talker-input builder (`omnimtp.handoff.TalkerInputBuilder`); prefill_block: a prefill
        longer than it projects its user rows in blocks of it (what talker prefix reuse needs)."""
        return Qwen3TalkerInputBuilder(self.model, prompt_ids, speaker, media, prefill_block)

    @staticmethod
    def reply_talker_inputs(builder, prompt_ids, output_ids, embeds, hidden, finish_reason) -> TalkerInputs:
        """The talker inputs of a finished reply from all its thinker rows [R, D], with transformers'
        single text projection over the reply (bit for bit what its `generate` hands the talker)."""
        rows = trimmed_thinker_rows(builder.thinker_dim, prompt_ids, output_ids, embeds, hidden, finish_reason)
        return builder.build(*rows, projection="reference")

    def speech_talker_inputs(self, ids: list[int], speaker: str) -> TalkerInputs:
        """Talker inputs that speak ids[len(header):] as if the thinker had replied with them: the rows
        are the thinker's input embeddings of the tokens (a text row's only thinker input)."""
        builder = Qwen3TalkerInputBuilder(self.model, self.speech_header_ids, speaker)
        embeds = self._speech_embeds(ids)
        return builder.build(embeds, embeds, projection="per_row")

    def speech_stream(self, speaker: str) -> SpeechTextStream:
        """`speech_talker_inputs` for ids that arrive in pieces (`omnimtp.handoff.SpeechTextStream`): the
        prefill needs the header and the first text id, and each later id makes its row alone."""
        builder = Qwen3TalkerInputBuilder(self.model, self.speech_header_ids, speaker)

        def text_rows(ids: list[int]) -> torch.Tensor:
            embeds = self._speech_embeds(ids)
            return builder.build_trailing(embeds, embeds)

        return SpeechTextStream(
            lambda ids: self.speech_talker_inputs(ids, speaker), text_rows, builder.num_prefill_rows
        )

    def _speech_embeds(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model.thinker.get_input_embeddings()(torch.tensor(ids, device=self.thinker_decoder.device))

    # --- talker ---

    def predictor(self, max_batch_size: int) -> CodePredictorRunner:
        """The code predictor runner for batches up to max_batch_size, made once per size."""
        if max_batch_size not in self._predictors:
            self._predictors[max_batch_size] = CodePredictorRunner(
                self.model.talker.code_predictor, max_batch_size, compile=self.compile_predictor,
                quantize=self.quantize,
            )
        return self._predictors[max_batch_size]

    def new_talker_batch(self, max_batch_size: int) -> TalkerBatch:
        return TalkerBatch(self.model.talker, max_batch_size, predictor=self.predictor(max_batch_size),
                           decoder=self.talker_decoder)

    @staticmethod
    def sampled_talker(thinker_sampling: SamplingParams | None) -> SamplingParams | None:
        """The talker sampling of a request that samples its thinker with `thinker_sampling`: greedy stays
        greedy, anything else samples the talker as transformers' `generate` does by default."""
        if thinker_sampling is None or thinker_sampling.is_greedy:
            return None
        return QWEN3_OMNI_TALKER_SAMPLING

    def warm_up(self, max_batch_size: int, on_bucket=None, stop=None, **options) -> bool:
        """Build the compiled predictor's graphs for every batch bucket up to max_batch_size, greedy and
        sampled (`CodePredictorRunner.warm_up`, whose keywords `options` are: safe beside serving, which runs
        eagerly meanwhile). Returns whether every bucket is warm (False for an eager predictor)."""
        return self.predictor(max_batch_size).warm_up(on_bucket, stop, **options)

    def per_request_tensors(self) -> list[torch.Tensor]:
        """The weights every spoken reply reads, whatever its tokens (what `omnimtp.runtime.prefetch` reads ahead
        of the first reply): the thinker's layers without their routed experts (a token reads 8 of 128: 15 GB at
        Qwen3-Omni-30B-A3B's size, more than a small box keeps resident) and its output head; the talker whole,
        its routed experts included (1.6 GB at that size: a reply's frames read most of them), its projections
        and code predictor; code2wav (the model's and the conv stack's copy in `codec_dtype`)."""
        thinker = self.model.thinker
        head = [thinker.lm_head.weight] if self.thinker_decoder.quantized_lm_head is None else []
        return [*self.thinker_decoder.tensors(routed_experts=False), *head, *self.talker_decoder.tensors(),
                *self.model.talker.parameters(), *self.model.code2wav.parameters(),
                *self.model.code2wav.buffers(), *self.codec.code2wav.parameters()]

    def routed_expert_tensors(self) -> list[torch.Tensor]:
        """The thinker's routed experts: each token reads the few its router picks (what `omnimtp.runtime.prefetch`
        reads ahead only where memory holds them)."""
        return [t for layer in self.thinker_decoder.layers for t in reachable_tensors(
            [getattr(layer, name) for name in sorted(ROUTED_EXPERT_FIELDS)])]

    # --- code2wav ---

    def new_codec_stream(self, speaker: str, generator: torch.Generator | None):
        """code2wav's stream state (code2wav has neither speaker nor noise: both unused)."""
        return self.codec.new_stream()

    def decode_audio(self, streams: list, blocks: list[torch.Tensor], is_final: list[bool]) -> list[np.ndarray]:
        """The next audio of several requests in one code2wav call: blocks[i] [G, n_i] continues
        streams[i]; chunk [a, b) holds samples [1920·a − 555, 1920·b − 555) of the one-shot decode
        (code2wav looks at no later frame, so is_final changes nothing)."""
        return [np.asarray(chunk, dtype=np.float32) for chunk in self.codec.decode(streams, blocks)]


def _audio_rows(lengths: torch.Tensor, config) -> list[int]:
    """Encoder rows of audios with `lengths` feature frames (the audio tower's downsampling)."""
    return _get_feat_extract_output_lengths(lengths, config.audio_config.n_window).tolist()
