"""Qwen2.5-Omni behind the engine's family interface: ids, the thinker run, the seed's talker inputs, the
single-codebook talker batch and token2wav (DiT flow matching + BigVGAN).

    thinker  dense Qwen2.5 LLM on packed weights; its rows: the input embeddings (multimodal rows zeroed) and
             the last hidden layer after the final norm (transformers' `hidden_states[-1]`)
    handoff  prefill [prompt rows] + [speaker bos (+ codec_pad)] + [first reply row (+ codec_bos)],
             ids [codec_mask] * P + [codec_pad, codec_bos]; one reply row per step, then the text pad row
             (`omnimtp.talker.qwen2_5_inputs`: the codec rows are added in the seed's layout, not in what
             transformers' `generate` runs with the checkpoint's EOS ids, the default here)
    talker   `omnimtp.talker.loop.TalkerBatch` with `Qwen2_5FrameMaker`: one code per frame
    codec    token2wav with the speaker's `cond` and `ref_mel` (`omnimtp.codec.token2wav`): the whole reply's
             codes at once (`generate`, bit for bit transformers'), or streamed in chunks with look-back /
             look-ahead context (`stream`; not the one-shot bits, see `benchmarks/token2wav_stream.py`)

    family = Qwen2_5OmniFamily(model, tokenizer)        # or Qwen2_5OmniFamily.tiny()
    core = EngineCore(family, EngineConfig())

Speakers come from the checkpoint's `spk_dict.pt` (`model.speaker_map`). The DiT starts from one
`torch.randn` of transformers' shape: from a seeded request's codec generator, else from torch's global RNG
at decode time (what transformers' `generate` draws).
"""

from __future__ import annotations

import numpy as np
import torch

from omnimtp.codec.token2wav import StreamingToken2Wav
from omnimtp.families.placeholders import check_placeholders, split_media
from omnimtp.families.text import ChatText, speech_header_ids
from omnimtp.handoff import SpeechTextStream, TalkerInputs, talker_inputs_from_rows
from omnimtp.media import MediaInputs
from omnimtp.packed_decoder import PackedDecoder
from omnimtp.runtime.ops import check_quantize
from omnimtp.sampling import SamplingParams
from omnimtp.talker.loop import QWEN2_5_OMNI_TALKER_SAMPLING, Qwen2_5FrameMaker, TalkerBatch
from omnimtp.talker.qwen2_5_inputs import PREFILL_LAYOUTS, Qwen2_5TalkerInputBuilder
from omnimtp.talker.qwen3_inputs import lookup_speaker, trimmed_thinker_rows
from omnimtp.thinker import PrefixRows, ThinkerRun

SAMPLE_RATE = 24_000


class Qwen2_5OmniFamily(ChatText):
    """Qwen2.5-Omni's side of the engine.

    model: transformers' `Qwen2_5OmniForConditionalGeneration` with `speaker_map` loaded; tokenizer: its text
    tokenizer, or None (then requests come as token ids and no text is decoded). processor: its audio and image
    processor (`omnimtp.media.load_processor`), or None when the checkpoint has none (then chat media is
    refused). Video comes as transformers' processor tensors with prompt ids that hold its placeholders.
    talker_layout: the talker prefill (`omnimtp.talker.qwen2_5_inputs`): "generate" (default) is what
    transformers' `generate` runs with the checkpoint's EOS ids (no codec pad / bos rows), "seed" the intended
    layout with both codec embeddings. quantize: the thinker's and talker's linears; stored: a quantized
    checkpoint's layers (`omnimtp.quantized_checkpoint`, as `Qwen3OmniFamily` takes them), with quantize its mode."""

    model_type = "qwen2_5_omni"  # the checkpoint's config.json model_type
    decoder_paths = ("thinker.model.language_model", "talker.model")  # the packed (and quantized) decoders
    sample_rate = SAMPLE_RATE
    num_code_groups = 1
    codec_looks_ahead = True  # token2wav holds a chunk's last samples back until later frames (or the end) come
    # Qwen2.5-Omni's cookbook asks for transcripts under this system line (universal_audio_understanding)
    transcription_system = "You are a speech recognition model."

    def __init__(self, model, tokenizer=None, *, processor=None, talker_layout: str = "generate",
                 quantize: str | None = None, stored: dict | None = None):
        check_quantize(quantize, model.thinker.device)
        self.quantize = quantize
        if talker_layout not in PREFILL_LAYOUTS:
            raise ValueError(f"talker_layout must be one of {PREFILL_LAYOUTS}, got {talker_layout!r}")
        self.talker_layout = talker_layout
        if not model.speaker_map:
            raise ValueError("model: no speakers (a Qwen2.5-Omni checkpoint keeps them in spk_dict.pt)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.processor = processor
        self.speakers = tuple(model.speaker_map)
        self.default_speaker = "Chelsie" if "Chelsie" in self.speakers else sorted(self.speakers)[0]
        text_config = model.config.thinker_config.text_config
        self.accept_hidden_layer = text_config.num_hidden_layers  # the last layer after the final norm
        self.max_positions = text_config.max_position_embeddings
        self.eos_token_ids = _thinker_eos_ids(model, tokenizer)
        thinker, talker = (PackedDecoder.from_module(model.get_submodule(path), quantize=quantize,
                                                     stored=(stored or {}).get(path)) for path in self.decoder_paths)
        if quantize is not None:  # its logits from an int8 head too (`PackedDecoder.with_quantized_lm_head`)
            thinker = thinker.with_quantized_lm_head(model.thinker.lm_head.weight)
        self.thinker_decoder, self.talker_decoder = thinker.with_row_kernel(), talker
        self.codec = StreamingToken2Wav(model.token2wav)
        self.speech_header_ids = speech_header_ids(tokenizer)

    @classmethod
    def tiny(cls, seed: int = 0, device=None, **kwargs) -> Qwen2_5OmniFamily:
        """A seeded tiny Qwen2.5-Omni (random weights: noise-like, audible speech), its byte tokenizer and its
        processor, on `device` (default the CPU)."""
        from omnimtp.media import tiny_processor
        from omnimtp.models.tiny_qwen2_5_omni import qwen2_5_byte_tokenizer, tiny_qwen2_5_omni
        from omnimtp.runtime.device import one_thread, resolve_device

        with one_thread():
            model = tiny_qwen2_5_omni(seed)
            if device is not None:
                model = model.to(resolve_device(device))
            tokenizer = qwen2_5_byte_tokenizer()
            processor = tiny_processor(tokenizer, model.config.thinker_config, "qwen2_5_omni")
            return cls(model, tokenizer, processor=processor, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.thinker_decoder.device

    # --- ids and text: `omnimtp.families.text.ChatText` ---

    def check_speaker(self, speaker: str) -> None:
        lookup_speaker(self.model.speaker_map, speaker)

    # --- media ---

    def check_media(self, prompt_ids: list[int], media: MediaInputs | None) -> None:
        """`omnimtp.families.placeholders.check_placeholders` with Qwen2.5-Omni's audio rows (its audio
        tower's `_get_feat_extract_output_lengths` of the feature frames)."""
        check_placeholders(self.model.config.thinker_config, prompt_ids, media, self._audio_rows)

    def split_media(self, prompts: list[list[int]], media: MediaInputs | None) -> list[MediaInputs | None]:
        """`omnimtp.families.placeholders.split_media`: the batch's tensors per prompt."""
        return split_media(self.model.config.thinker_config, prompts, media)

    def _audio_rows(self, lengths: torch.Tensor) -> list[int]:
        return self.model.thinker.model.audio_tower._get_feat_extract_output_lengths(lengths)[1].tolist()

    # --- thinker ---

    def new_thinker(self, prompts: list[list[int]], sampling: list[SamplingParams | None],
                    generators: list[torch.Generator], max_new_tokens: int,
                    media: list[MediaInputs | None] | None = None, prefill_block: int | None = None,
                    prefixes: list[PrefixRows | None] | None = None,
                    keeps_prefix: list[bool] | None = None, plain_start_steps: int = 0,
                    logprobs: list[int | None] | None = None) -> ThinkerRun:
        """One thinker run over `prompts` (one KV slot each), each row's media encoded in its prefill
        (`omnimtp.thinker.multimodal_prefill`); its hidden rows are the last layer after the final norm, what
        transformers hands the talker."""
        return ThinkerRun(
            self.model.thinker, prompts, accept_hidden_layer=self.accept_hidden_layer,
            eos_token_ids=self.eos_token_ids, max_new_tokens=max_new_tokens, sampling=sampling,
            generators=generators, decoder=self.thinker_decoder, media=media, prefill_block=prefill_block,
            prefixes=prefixes, keeps_prefix=keeps_prefix,
            plain_start_steps=plain_start_steps, logprobs=logprobs,
        )

    # --- thinker → talker ---

    def talker_builder(
        self, prompt_ids: list[int], speaker: str, media: MediaInputs | None = None, prefill_block: int | None = None
    ) -> Qwen2_5TalkerInputBuilder:
        """The request's talker-input builder. Its prefill rows are sums of thinker rows, each row on its own, so
        they need no blocks (prefill_block is unused); the talker's projection runs per prefill block at admission."""
        return Qwen2_5TalkerInputBuilder(self.model, prompt_ids, speaker, self.talker_layout)

    def reply_talker_inputs(self, builder, prompt_ids, output_ids, embeds, hidden, finish_reason) -> TalkerInputs:
        """The talker inputs of a finished reply from all its thinker rows [R, D] (the stop-row trim, then
        the seed's layout; row by row, so the same bits as the streamed handoff and as transformers)."""
        dim = self.model.config.thinker_config.text_config.hidden_size
        rows = trimmed_thinker_rows(dim, prompt_ids, output_ids, embeds, hidden, finish_reason)
        return talker_inputs_from_rows(builder, *rows)

    def speech_talker_inputs(self, ids: list[int], speaker: str) -> TalkerInputs:
        """Talker inputs that speak ids[len(header):]: each row is the token's thinker input embedding (its
        hidden part zero, since no thinker ran). transformers has no such path: an approximation."""
        builder = Qwen2_5TalkerInputBuilder(self.model, self.speech_header_ids, speaker, self.talker_layout)
        embeds = self._speech_embeds(ids)
        return talker_inputs_from_rows(builder, embeds, torch.zeros_like(embeds))

    def speech_stream(self, speaker: str) -> SpeechTextStream:
        """`speech_talker_inputs` for ids that arrive in pieces (`omnimtp.handoff.SpeechTextStream`): the
        prefill needs the header and the first text id, and each later id makes its row alone."""
        builder = Qwen2_5TalkerInputBuilder(self.model, self.speech_header_ids, speaker, self.talker_layout)

        def text_rows(ids: list[int]) -> torch.Tensor:
            embeds = self._speech_embeds(ids)
            return builder.build_trailing(embeds, torch.zeros_like(embeds))

        return SpeechTextStream(
            lambda ids: self.speech_talker_inputs(ids, speaker), text_rows, builder.num_prefill_rows
        )

    def _speech_embeds(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model.thinker.get_input_embeddings()(torch.tensor(ids, device=self.device))  # [N, D]

    # --- talker ---

    def new_talker_batch(self, max_batch_size: int) -> TalkerBatch:
        talker = self.model.talker
        return TalkerBatch(talker, max_batch_size, decoder=self.talker_decoder, frames=Qwen2_5FrameMaker(talker))

    @staticmethod
    def sampled_talker(thinker_sampling: SamplingParams | None) -> SamplingParams | None:
        """Greedy stays greedy; a sampled thinker samples the talker as transformers' `generate` defaults."""
        if thinker_sampling is None or thinker_sampling.is_greedy:
            return None
        return QWEN2_5_OMNI_TALKER_SAMPLING

    def warm_up(self, max_batch_size: int, on_bucket=None, stop=None, **options) -> bool:
        """Nothing is compiled: nothing to warm up."""
        return False

    def per_request_tensors(self) -> list[torch.Tensor]:
        """The weights every spoken reply reads (what `omnimtp.runtime.prefetch` reads ahead of the first reply):
        the thinker's layers (dense: every token reads them all) and its output head, the talker with its
        projections and head, token2wav."""
        thinker = self.model.thinker
        head = [thinker.lm_head.weight] if self.thinker_decoder.quantized_lm_head is None else []
        return [*self.thinker_decoder.tensors(), *head, *self.talker_decoder.tensors(), *self.model.talker.parameters(),
                *self.model.token2wav.parameters(), *self.model.token2wav.buffers()]

    # --- token2wav ---

    def new_codec_stream(self, speaker: str, generator: torch.Generator | None):
        params = lookup_speaker(self.model.speaker_map, speaker)
        device = self.model.token2wav.device
        conditioning = params["cond"].to(device).float()[None]  # [1, enc_emb_dim]
        reference_mel = params["ref_mel"].to(device).float()  # [1, frames, mel_dim]
        return self.codec.new_stream(conditioning, reference_mel, generator)

    def decode_audio(self, streams: list, blocks: list[torch.Tensor], is_final: list[bool]) -> list[np.ndarray]:
        """blocks[i] [1, n_i] continues streams[i]. The DiT looks ahead, so a non-final block may give less audio
        than it covers (or none); the final block flushes. A request decoded in one final block (`generate`) is
        transformers' one-shot token2wav."""
        return self.codec.decode(streams, blocks, is_final)


def _thinker_eos_ids(model, tokenizer) -> set[int]:
    """<|im_end|> (the tokenizer's EOS) and the EOS ids of the generation configs: the checkpoint's
    generation_config.json, which loading puts on the top-level model (the thinker's stays empty), and the
    thinker's own."""
    ids = set()
    for generation_config in (model.generation_config, model.thinker.generation_config):
        configured = None if generation_config is None else generation_config.eos_token_id
        if configured is not None:
            ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer is not None:
        for token_id in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")):
            if token_id is not None and token_id != tokenizer.unk_token_id:
                ids.add(int(token_id))
    if not ids:
        raise ValueError("model: no thinker EOS id (neither its generation config nor a tokenizer gives one)")
    return ids
