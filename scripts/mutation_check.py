"""Mutation check: does the test suite notice when speech, sampling or speculative decoding break?

Each mutation replaces one snippet of one source file with a plausible bug. The script copies the working
tree (git-tracked files plus untracked, not ignored ones) into a scratch directory, checks that the
unmutated baseline of every selected test file passes there, then applies one mutation at a time, runs
that mutation's tests (`python -m pytest -x`, one thread) and restores the file. A mutation is caught when
pytest fails (exit code 1, or 2 when collection breaks); it survives when the tests pass. The repository
itself is never written.

    python scripts/mutation_check.py                       # every mutation; markdown table on stdout
    python scripts/mutation_check.py --only resample_from_p always_accept --json out.json
    python scripts/mutation_check.py --only rejection_resample_from_p --tests tests/test_spec_distribution.py
    python scripts/mutation_check.py --list
    python scripts/mutation_check.py --check-snippets        # every snippet still occurs once (no tests run)

A mutation whose old snippet does not occur exactly once in its file is refused (exit 2), so an entry
cannot silently stop testing anything after the code moves. Exit code 1 when a mutation survives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CODEC = ("tests/test_codec_streaming.py", "tests/test_pipeline.py", "tests/test_server_scheduling.py")
TALKER = ("tests/test_pipeline_talker_loop.py", "tests/test_pipeline.py", "tests/test_server_scheduling.py")
CODE_PREDICTOR = ("tests/test_code_predictor_distribution.py", "tests/test_sampling.py", "tests/test_code_predictor.py")
HANDOFF = ("tests/test_handoff.py", "tests/test_handoff_stream.py")
REJECTION = ("tests/test_rejection.py", "tests/test_rejection_distribution.py", "tests/test_spec_distribution.py")
SAMPLING = ("tests/test_sampling.py", "tests/test_spec_distribution.py")
SPEC = ("tests/test_spec_generate.py", "tests/test_packed_target.py", "tests/test_spec_distribution.py")
MEDIA = ("tests/test_media_input.py",)
HYBRID = ("tests/test_spec_hybrid.py",)
THINKER_SPEC = ("tests/test_thinker_spec.py",)
ADAPTIVE = ("tests/test_adaptive_drafting.py",)
QWEN2_5 = ("tests/test_qwen2_5_omni.py", "tests/test_qwen2_5_talker_inputs.py")
TOKEN2WAV = ("tests/test_token2wav.py", "tests/test_qwen2_5_omni.py")
ENGINE_ROWS = ("tests/test_engine_rows.py",)
THINKER_DRAFTS = ("tests/test_thinker_drafts.py",)
QWEN3_TTS = ("tests/test_qwen3_tts.py",)
QWENTTS_PEER = ("tests/test_qwentts_peer.py",)
SPEECH_TOKENIZER = ("tests/test_speech_tokenizer.py",)
STREAMED_CONV = ("tests/test_codec_streaming.py",)
CODEC_TRANSFORMER = ("tests/test_codec_transformer.py",)
QUANTIZED = ("tests/test_quantized_linear.py",)
SCREENED_HEAD = ("tests/test_screened_head.py",)
KERNELS_BUILD = ("tests/test_kernels_build.py",)
QUANTIZED_EXPERTS = ("tests/test_quantized_experts.py",)
QUANTIZED_CHECKPOINT = ("tests/test_quantized_checkpoint.py",)
QUANTIZED_SPEC = ("tests/test_quantized_spec.py",)
VOICE_CLONE = ("tests/test_voice_clone.py",)
REALTIME = ("tests/test_server_realtime.py",)
PREFIX_CACHE = ("tests/test_prefix_cache.py",)
VOICE_AGENT = ("tests/test_realtime_vad.py",)
REALTIME_WORDS = ("tests/test_realtime_words.py",)
QWEN3_ASR = ("tests/test_qwen3_asr.py",)
W8A8 = ("tests/test_w8a8_linear.py",)
BF16_ATTENTION = ("tests/test_bf16_attention.py",)
BF16_ROWS = ("tests/test_bf16_rows_linear.py", "tests/test_speech_tokenizer.py")
W8A8_EPILOGUES = ("tests/test_w8a8_epilogues.py",)
W8A8_CONV = ("tests/test_w8a8_conv.py",)
ENCODER_EPILOGUE = ("tests/test_encoder_epilogue.py",)
QWEN3_ALIGNER = ("tests/test_qwen3_aligner.py",)
ASR_SERVER = ("tests/test_server_asr.py",)
VOICE_STORE = ("tests/test_voice_store.py",)
SERVER_VOICES = ("tests/test_server_voices.py",)
SPEECH_STREAM = ("tests/test_speech_stream.py",)
LONG_SPEECH = ("tests/test_text_segments.py", "tests/test_long_speech.py")
TRANSCRIPTION = ("tests/test_transcription.py",)
SERVER_HARDENING = ("tests/test_server_hardening.py",)
SERVER_STRUCTURE = ("tests/test_server_structure.py",)
SERVER = ("tests/test_server.py",)
ADMISSION = ("tests/test_admission.py",)
REFUSALS = ("tests/test_refusals.py",)


# filter_logits' three steps, verbatim, to reorder them.
_TEMPERATURE = (
    "    if params.temperature != 1.0:\n"
    "        scores = scores / params.temperature\n"
)
_TOP_K = (
    "    if params.top_k:\n"
    "        k = min(params.top_k, scores.shape[-1])\n"
    "        kth = torch.topk(scores, k, dim=-1).values[..., -1:]\n"
    "        scores = scores.masked_fill(scores < kth, float(\"-inf\"))\n"
)
_TOP_P = (
    "    if params.top_p < 1.0:\n"
    "        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)\n"
    "        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)\n"
    "        sorted_remove = cumulative <= (1.0 - params.top_p)\n"
    "        sorted_remove[..., -1:] = False\n"
    "        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)\n"
    "        scores = scores.masked_fill(remove, float(\"-inf\"))\n"
)

@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest paths or node ids, relative to the repository root
    description: str


MUTATIONS = [
    # --- speech: codec ------------------------------------------------------------------------------
    Mutation(
        "codec_all_zero_audio", "omnimtp/codec/streaming.py",
        "audio[i] = wavs[row].float().cpu().numpy()",
        "audio[i] = (0 * wavs[row]).float().cpu().numpy()",
        CODEC, "the streaming code2wav returns silence of the right length",
    ),
    Mutation(
        "codec_zero_first_sample_of_chunk", "omnimtp/codec/streaming.py",
        "                audio[i] = wavs[row].float().cpu().numpy()",
        "                audio[i] = wavs[row].float().cpu().numpy()\n"
        "                audio[i][:1] = 0.0",
        CODEC, "the first sample of every decoded chunk is zeroed",
    ),
    Mutation(
        "codec_batched_convolutions", "omnimtp/codec/streaming.py",
        "    _ROWWISE = {F.conv1d, F.conv_transpose1d, F.linear}",
        "    _ROWWISE = set()",
        CODEC, "code2wav runs its convolutions batched across requests (rounding then depends on the batch)",
    ),
    Mutation(
        "codec_transformer_drops_kv_cache", "omnimtp/codec/stream_transformer.py",
        "        cache.commit_positions(slots, counts)\n",
        "",
        CODEC, "the codec transformer starts a new KV cache for every chunk",
    ),
    Mutation(
        "codec_transformer_window_dropped", "omnimtp/codec/stream_transformer.py",
        "mask = ((keys <= columns) & (keys > columns - self.window))[:, None, None]",
        "mask = (keys <= columns)[:, None, None]",
        CODEC_TRANSFORMER, "a streamed codec frame attends to every cached frame, not its 72-frame window",
    ),
    Mutation(
        "codec_transformer_slide_loses_positions", "omnimtp/runtime/kv_cache.py",
        "            self.rope_offsets[slot] += length - keep\n",
        "",
        CODEC_TRANSFORMER, "a sliding KV slot's kept keys take new RoPE positions (the stream's frames lose theirs)",
    ),
    Mutation(
        "codec_transformer_rows_on_mkl", "omnimtp/codec/stream_transformer.py",
        "mask, packed_layers=decoder.row_kernel, gemm=gemm)",
        "mask)",
        CODEC_TRANSFORMER, "a call's streams run their codec transformer rows as one MKL matmul (batch-dependent bits)",
    ),
    # --- Qwen3-TTS: the 12 Hz speech tokenizer decoder ------------------------------------------------
    Mutation(
        "codec_causal_conv_forgets_its_tail", "omnimtp/codec/streaming.py",
        "    return out, extended[..., x.shape[-1] :]",
        "    return out, torch.zeros_like(extended[..., x.shape[-1] :])",
        STREAMED_CONV, "every causal conv of the stack starts each chunk from zeros, as if the stream were new",
    ),
    Mutation(
        "codec_causal_conv_tail_one_step_short", "omnimtp/codec/streaming.py",
        "    return out, extended[..., x.shape[-1] :]",
        "    return out, torch.cat([0 * extended[..., :1], extended[..., x.shape[-1] + 1 :]], dim=-1)",
        STREAMED_CONV, "a causal conv keeps one input fewer than its kernel needs (the oldest zeroed)",
    ),
    Mutation(
        "codec_transposed_conv_forgets_its_input", "omnimtp/codec/streaming.py",
        "            stream.conv_states[slot] = extended[row : row + 1, :, x.shape[-1] :].clone()",
        "            stream.conv_states[slot] = torch.zeros_like(extended[row : row + 1, :, x.shape[-1] :])",
        STREAMED_CONV, "a transposed conv's first outputs of a chunk miss the previous chunk's last input",
    ),
    Mutation(
        "codec_batch_rows_share_a_conv_state", "omnimtp/codec/streaming.py",
        "            stream.conv_states[slot] = tail[row : row + 1].clone()  # not a view of the whole input",
        "            stream.conv_states[slot] = tail[:1].clone()",
        STREAMED_CONV, "every stream of a batched call keeps the first stream's causal-conv tails",
    ),
    Mutation(
        "codec_transposed_conv_left_trim_every_chunk", "omnimtp/codec/streaming.py",
        "start = tail.shape[-1] * conv.stride[0] + (module.left_pad if is_start else 0)",
        "start = tail.shape[-1] * conv.stride[0] + module.left_pad",
        STREAMED_CONV, "Qwen3-Omni's transposed convs drop their left trim in every chunk, not only the first",
    ),
    Mutation(
        "tts_codec_pre_conv_forgets_its_tail", "omnimtp/codec/speech_tokenizer.py",
        "latent, stream.quantized_tail = causal_conv_step(decoder.pre_conv, quantized, stream.quantized_tail)",
        "latent, _ = causal_conv_step(decoder.pre_conv, quantized, stream.quantized_tail)",
        SPEECH_TOKENIZER, "the causal pre-conv starts each chunk from zeros instead of the last two quantizer frames",
    ),
    Mutation(
        "tts_codec_codebook_is_the_raw_ema_sum", "omnimtp/codec/speech_tokenizer.py",
        "                module._embed = None",
        "                module._embed = module.embed_sum",
        SPEECH_TOKENIZER, "the codebook lookup uses the EMA embedding_sum without dividing by cluster_usage",
    ),
    Mutation(
        "tiny_temperature_divides", "omnimtp/sampling.py",
        "        return self.temperature < MIN_SAMPLED_TEMPERATURE",
        "        return self.temperature == 0.0",
        SAMPLING, "a temperature of 1e-38 divides the logits into infinities instead of being greedy",
    ),
    Mutation(
        "sampled_probs_may_be_nan", "omnimtp/sampling.py",
        "    return torch.where(is_bad, fallback, probs)",
        "    return probs",
        SAMPLING, "overflowed scores give NaN probabilities (token 0 every step)",
    ),
    # --- adaptive drafting ---------------------------------------------------------------------------
    Mutation(
        "adaptive_tie_picks_more_drafts", "omnimtp/spec_decode/adaptive.py",
        "key=lambda i: (goodput[i], -i))  # ties: the fewer drafts",
        "key=lambda i: (goodput[i], i))  # ties: the fewer drafts",
        ADAPTIVE, "a goodput tie picks the larger k",
    ),
    Mutation(
        "adaptive_probe_drafts_one", "omnimtp/spec_decode/adaptive.py",
        "        probe = max(range(1, len(goodput)), key=lambda i: (goodput[i], -i))",
        "        probe = 1",
        ("tests/test_adaptive_drafting.py::test_a_probe_drafts_the_k_of_best_goodput_on_a_worked_example",),
        "a probe always drafts one token, not the k of best goodput among k >= 1",
    ),
    Mutation(
        "draft_costs_kept_across_kernel_builds", "omnimtp/spec_decode/cost_cache.py",
        '        "kernel": small_batch_linear.build_id(),',
        '        "kernel": None,',
        ("tests/test_adaptive_drafting.py::test_the_fingerprint_changes_with_the_kernel_build",),
        "draft costs measured with one build of the kernel are read back for another (other ISA, tiling, source)",
    ),
    Mutation(
        "adaptive_k_from_the_clock", "omnimtp/spec_decode/adaptive.py",
        "k = max(range(len(goodput)), key=lambda i: (goodput[i], -i))  # ties: the fewer drafts",
        "k = __import__(\"time\").perf_counter_ns() // 1000 % len(goodput)",
        ADAPTIVE, "the adaptive controller picks k from the clock: a seeded request no longer repeats",
    ),
    Mutation(
        "adaptive_prior_ignores_the_measured_acceptance", "omnimtp/spec_decode/adaptive.py",
        "            prior = self.costs.acceptance",
        "            prior = DEFAULT_PRIOR",
        ADAPTIVE, "every request starts at 0.7 whatever acceptance its drafter showed while the costs were "
        "measured: a well-trained drafter's 16-row batches start plain and never get their drafts",
    ),
    Mutation(
        "adaptive_probes_where_drafting_never_pays", "omnimtp/spec_decode/adaptive.py",
        "        if k > 0 or not self._drafting_pays_at_the_prior(costs):",
        "        if k > 0:",
        ADAPTIVE, "a batch whose drafts do not pay at the prior still probes: each probe pays the drafter's "
        "catch-up over every skipped slot, and 16-row batches of the demo LM run slower than plain",
    ),
    Mutation(
        "adaptive_decision_kept_after_the_estimates_move", "omnimtp/spec_decode/adaptive.py",
        "        key = (tuple(rows), id(costs))",
        "        key = (len(rows), id(costs))",
        ADAPTIVE, "the k decided for a run of plain steps is kept after verifications moved the estimates: a "
        "request whose drafts started paying again stays plain",
    ),
    Mutation(
        "decoder_quantized_while_packed_stays_float", "omnimtp/runtime/decoder.py",
        "            if quantize is None:\n                packed_layers = tuple(",
        "            if True:\n                packed_layers = tuple(",
        QUANTIZED, "a decoder asked to quantize while packing keeps its float layers and runs them: quantize set, "
        "no quantized matrix",
    ),
    Mutation(
        "kernel_source_stops_compiling", "omnimtp/runtime/kernels/bf16_attention.c",
        "int omnimtp_bf16_attention_supported(void) {",
        "int omnimtp_bf16_attention_supported(void) { undeclared_name;",
        KERNELS_BUILD, "a kernel source that no longer compiles: every test of that kernel skips, and only the "
        "build check fails",
    ),
    Mutation(
        "screened_head_token_from_the_int4_screen", "omnimtp/runtime/screened_head.py",
        "        return top.gather(1, own.argmax(dim=-1, keepdim=True))[:, 0]",
        "        return scores.argmax(dim=-1)",
        SCREENED_HEAD, "a greedy step takes the int4 screen's own argmax, not the int8 head's among its candidates: "
        "tokens that differ from the int8 head's where logits are flat",
    ),
    Mutation(
        "screened_head_used_for_logprobs", "omnimtp/thinker.py",
        "        if any(self.logprobs[i] is not None or not (",
        "        if any(False and not (",
        SCREENED_HEAD, "a step with a request asking for log-probabilities takes its tokens from the screen and has "
        "no logits to compute them from",
    ),
    Mutation(
        "screened_head_never_used", "omnimtp/thinker.py",
        "        if head is None or self.speculation is not None:\n            return None\n        if any(",
        "        if True:\n            return None\n        if any(",
        SCREENED_HEAD, "a quantized Qwen3-ASR holds the int4 screen of its head and still reads the whole int8 head "
        "every greedy step",
    ),
    Mutation(
        "quantized_mtp_target_logits_from_the_float_head", "omnimtp/spec_decode/packed_target.py",
        "    if packed.quantized_lm_head is not None:\n        return linear(",
        "    if False:\n        return linear(",
        QUANTIZED_SPEC, "a quantized MTP target quantizes its LM head and still computes its logits with the float "
        "one: the head's bytes read in fp32 every step",
    ),
    Mutation(
        "quantized_mtp_checkpoint_target_repacked_from_its_placeholders", "omnimtp/spec_decode/packed_target.py",
        "    stored = _STORED.get(target)\n    if stored is not None:",
        "    stored = None\n    if stored is not None:",
        QUANTIZED_SPEC, "a target loaded from a quantized MTP checkpoint is packed from its zero-stride placeholders "
        "instead of its stored matrices: zeros for every layer",
    ),
    Mutation(
        "calibration_times_the_catch_up_step", "omnimtp/spec_decode/adaptive.py",
        "    return ks, [k != 1 or i != 2 for i, k in enumerate(ks)]",
        "    return ks, [True for i, k in enumerate(ks)]",
        ADAPTIVE, "calibration times the drafting step that reads the plain steps' slots as a k = 1 step: "
        "the catch-up a run pays once per run of plain steps inflates c_1",
    ),
    Mutation(
        "calibration_counts_plain_steps_in_the_acceptance", "omnimtp/spec_decode/adaptive.py",
        "                    if timed and k > 0:",
        "                    if timed:",
        ADAPTIVE, "the prior acceptance counts what plain steps report, which verified no draft",
    ),
    Mutation(
        "transposed_conv_matmul_overlap_added_the_wrong_way", "omnimtp/codec/streaming.py",
        "        out[:, j:] += taps[:, : length - j, :, j]",
        "        out[:, : length - j] += taps[:, j:, :, j]",
        SPEECH_TOKENIZER, "a large transposed convolution's matmul form adds each tap block to the output block "
        "before its input instead of after: the 0.6B decoder's audio is wrong",
    ),
    Mutation(
        "quantized_code_predictor_heads_left_float", "omnimtp/talker/code_predictor.py",
        "gemm.lm_heads if gemm is not None else w.quantized_lm_heads or [None] * len(lm_heads)",
        "gemm.lm_heads if gemm is not None else [None] * len(lm_heads)",
        QUANTIZED, "a quantized code predictor runs its 15 heads in fp32: four times the bytes a frame for the "
        "heads it quantized and holds",
    ),
    Mutation(
        "conv_stack_batches_rows_that_overflow_the_cache", "omnimtp/codec/streaming.py",
        "if rows > 1 and frames * self.output_rate_bytes_per_frame >= ROW_STACK_BYTES:",
        "if rows > 1 and frames * self.output_rate_bytes_per_frame < 0:",
        CODEC, "large decode windows run batched: at 8 streams the 0.6B decoder's activations stream from memory "
        "(1.25x the time)",
    ),
    Mutation(
        "quantized_text_rows_projected_an_id_at_a_time", "omnimtp/families/qwen3_tts.py",
        "        if self._text_projection is not None:\n            return self._text_rows(torch.tensor([ids]",
        "        if self._text_projection is None and not ids:\n            return self._text_rows(torch.tensor([ids]",
        QUANTIZED, "a quantized Qwen3-TTS projects its trailing text rows a call per id: the 0.6B projection's "
        "matrices read once per text token before the first audio",
    ),
    Mutation(
        "tts_talker_steps_off_the_row_kernel", "omnimtp/families/qwen3_tts.py",
        "self.talker_decoder = PackedDecoder.from_module(self.talker.model).with_row_kernel()",
        "self.talker_decoder = PackedDecoder.from_module(self.talker.model)",
        QWEN3_TTS, "the fp32 Qwen3-TTS talker's steps run matrix-vector products again: the 0.6B talker at one row "
        "117 instead of 63 ms a frame step",
    ),
    Mutation(
        "fp32_predictor_row_kernel_only_on_avx512", "omnimtp/runtime/ops.py",
        "if dtype == torch.float32 and small_batch_linear.available():",
        'if dtype == torch.float32 and small_batch_linear.isa() == "AVX512" and small_batch_linear.available():',
        ("tests/test_code_predictor.py",), "an fp32 code predictor on an AVX2 CPU runs MKL and F.linear again: "
        "the 0.6B Qwen3-TTS predictor's frame 2.0-2.6x slower",
    ),
    Mutation(
        "short_transposed_convolutions_off_the_row_kernel", "omnimtp/codec/streaming.py",
        "packed = row_kernel_weight(module, taps_matrix, hidden_state.transpose(1, 2))",
        "packed = None",
        ("tests/test_speech_tokenizer.py",), "a stream's first chunk runs the 0.6B decoder's transposed "
        "convolutions on MKL's matmul and torch's reference convolution again: ~25 ms more before the first audio",
    ),
    Mutation(
        "codec_linears_off_the_row_kernel", "omnimtp/codec/streaming.py",
        "        use_row_kernel_layers(code2wav)\n", "",
        ("tests/test_codec_streaming.py",), "a stream's chunks run the decoder transformer's and the ConvNeXt "
        "blocks' linears and the causal convolutions on MKL and oneDNN again: the 0.6B decoder's first chunk ~25 ms "
        "slower",
    ),
    Mutation(
        "bf16_short_convolutions_on_onednn", "omnimtp/codec/streaming.py",
        "SHORT_MATMUL_MAX_STEPS = 128", "SHORT_MATMUL_MAX_STEPS = 0",
        ("tests/test_speech_tokenizer.py",), "a bf16 decoder's short chunks run oneDNN's bf16 convolutions again: "
        "the 0.6B decoder's one-frame chunk ~1.35x the CPU time",
    ),
    Mutation(
        "bf16_short_pointwise_convolutions_as_matmuls", "omnimtp/codec/streaming.py",
        "if packed is None and not rows_kernel and (conv.kernel_size == (1,) or not _short_matmul(matrix, extended, "
        "length)):",
        "if packed is None and not rows_kernel and not _short_matmul(matrix, extended, length):",
        ("tests/test_speech_tokenizer.py",), "a bf16 stack's short pointwise convolutions run as matmuls too: "
        "0.58 against 0.28 ms a 768-channel layer at a frame's 32 steps (one thread)",
    ),
    Mutation(
        "bf16_large_transposed_weights_in_the_convolutions_layout", "omnimtp/codec/streaming.py",
        "            weight.data = weight.detach().flatten(1).t().contiguous().t().view(weight.shape)\n", "",
        ("tests/test_speech_tokenizer.py",), "a bf16 decoder's 1536 -> 768 transposed convolution reads its weight "
        "as a row-major [K, N] operand again: 4.5 instead of 1.8 ms a short chunk (one thread)",
    ),
    Mutation(
        "bf16_rows_kernel_sums_in_an_order_that_follows_the_rows", "omnimtp/runtime/kernels/bf16_rows_linear.c",
        "    UNROLL for (int i = 0; i < R; ++i) sum4(acc[i], sums[i]);",
        "    UNROLL for (int i = 0; i < R; ++i) { sum4(acc[i], sums[i]); if (R == DOT_ROWS) "
        "for (int j = 0; j < DOT_COLUMNS; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]); }",
        BF16_ROWS, "a row's sums are added up in another order where it shares a tile of 6 rows: a stream's bf16 "
        "audio would depend on the streams decoded beside it",
    ),
    Mutation(
        "bf16_rows_kernel_panel_order_follows_the_rows", "omnimtp/runtime/kernels/bf16_rows_linear.c",
        "    for (int64_t p = 0; p < pairs; ++p) {",
        "    for (int64_t q = 0; q < pairs; ++q) { const int64_t p = R == PANEL_ROWS ? pairs - 1 - q : q;",
        BF16_ROWS, "a transposed convolution's taps are summed backwards in a full tile of rows: a row's bits "
        "depend on how many rows share the call",
    ),
    Mutation(
        "bf16_rows_kernel_drops_the_last_inputs", "omnimtp/runtime/kernels/bf16_rows_linear.c",
        "    if (whole < K) { /* the same lanes, the rest of them zeros */",
        "    if (0) { /* the same lanes, the rest of them zeros */",
        BF16_ROWS, "a linear layer whose inputs are not a multiple of 32 drops the last ones from its sums",
    ),
    Mutation(
        "bf16_convnext_linears_off_the_rows_kernel", "omnimtp/codec/streaming.py",
        "hidden = _linear(module.pwconv2, module.act(_linear(module.pwconv1, module.norm(hidden))))",
        "hidden = module.pwconv2(module.act(module.pwconv1(module.norm(hidden))))",
        ("tests/test_speech_tokenizer.py",), "a bf16 stack's ConvNeXt linears run torch's matmul a stream at a "
        "time again (every 1024 x 4096 weight read once a stream)",
    ),
    Mutation(
        "bf16_rows_kernel_off_in_the_codec", "omnimtp/codec/streaming.py",
        "BF16_ROWS_MAX_STEPS = 17", "BF16_ROWS_MAX_STEPS = 0",
        ("tests/test_speech_tokenizer.py",), "a bf16 decoder's few-step chunks run torch's bf16 matmul one stream at "
        "a time again: two streams' upsampling and 1536 -> 768 layers read their weights twice",
    ),
    Mutation(
        "pad_skipped_for_a_wide_causal_conv", "omnimtp/codec/streaming.py",
        "if type(child) is Qwen3OmniMoeCausalConvNet and child.kernel_size == 1 and child.stride == 1:",
        "if type(child) is Qwen3OmniMoeCausalConvNet and child.stride == 1:",
        ("tests/test_codec_streaming.py",), "every stride-1 causal convolution skips its pad, kernel 7 included: "
        "its output loses the causal left context",
    ),
    Mutation(
        "engine_skips_thinker_steps_its_talker_waits_for", "omnimtp/engine/core.py",
        "self.talker.num_text_rows(r.request_id) > 0 for r in thinking",
        "self.talker.num_text_rows(r.request_id) >= 0 for r in thinking",
        THINKER_SPEC, "while a first audio is due, a cohort skips its thinker step though its talker holds no reply "
        "row: its audio stalls",
    ),
    Mutation(
        "adaptive_costs_of_the_whole_cohort", "omnimtp/spec_decode/adaptive.py",
        "costs = self.costs.for_batch(len(rows) if num_step_rows is None else num_step_rows)",
        "costs = self.costs.for_batch(len(active) if num_step_rows is None else num_step_rows)",
        ADAPTIVE, "k is chosen with the costs of the cohort's first size: finished requests still count, so a "
        "shrinking cohort never switches to the k its smaller batch pays for",
    ),
    Mutation(
        "adaptive_drafter_skips_the_plain_steps_slots", "omnimtp/spec_decode/generate.py",
        "block = with_plain_steps(block, plain_steps, next_position - len(plain_steps), kv_mask)",
        "block = with_plain_steps(block, plain_steps[-1:], next_position - 1, kv_mask)",
        ADAPTIVE, "after plain steps the drafter reads only the newest slot (its cache falls out of line)",
    ),
    Mutation(
        "spec_dropped_rows_keep_their_controller_estimates", "omnimtp/spec_decode/generate.py",
        "            controller.keep_rows(kept)\n",
        "",
        ADAPTIVE, "finished rows leave the batch but not the controller, which then decides with a stale "
        "row count",
    ),
    Mutation(
        "spec_dropped_rows_stay_in_the_drafter", "omnimtp/spec_decode/generate.py",
        "            block = select_rows(block, index)\n",
        "",
        SPEC, "the drafter's block keeps the finished rows the target's cache dropped",
    ),
    Mutation(
        "dsa_plain_steps_after_holes_use_transformers_forward", "omnimtp/spec_decode/generate.py",
        "if dsa and (ids.shape[1] > 1 or has_holes):",
        "if dsa and ids.shape[1] > 1:",
        ("tests/test_spec_glm5.py",), "a GLM-5 plain step after rejected drafts left holes runs transformers' "
        "forward, whose indexer then sorts another array than decoding does",
    ),
    Mutation(
        "dsa_batched_selection_ignores_holes", "omnimtp/mtp/dsa.py",
        "whole = allowed[:, t, num_prompt_slots:length].all(dim=-1)",
        "whole = allowed[:, t, :length].any(dim=-1)",
        ("tests/test_spec_glm5.py",), "rows with holes join the batched top-k over their full columns",
    ),
    Mutation(
        "thinker_finished_rows_stay_in_the_drafter", "omnimtp/thinker.py",
        "if self.drops_rows and any(self.finish_reasons[i] is not None for i in layout.requests):",
        "if False:",
        THINKER_SPEC, "a thinker cohort keeps drafting for its finished requests",
    ),
    Mutation(
        "thinker_dropped_rows_stay_in_the_proposer", "omnimtp/thinker.py",
        "                if self.proposer is not None:  # one made later has read no rows yet\n"
        "                    self.proposer.keep_rows(kept)\n",
        "",
        THINKER_SPEC, "the thinker's layout drops a finished request's row but its proposer keeps it",
    ),
    Mutation(
        "thinker_proposer_made_at_the_start", "omnimtp/thinker.py",
        "            self.proposer: Proposer | None = None\n",
        "            self.proposer: Proposer | None = speculation.new_proposer()\n",
        THINKER_SPEC, "a speculative run makes its drafter before its prefill, on the way to a new request's first "
        "audio",
    ),
    Mutation(
        "thinker_rows_dropped_from_a_drafter_not_made_yet", "omnimtp/thinker.py",
        "                if self.proposer is not None:  # one made later has read no rows yet\n",
        "                if True:\n",
        THINKER_SPEC, "a row that finishes before the run's first drafting step is dropped from a drafter that "
        "does not exist yet",
    ),
    Mutation(
        "mtp_proposer_keeps_dropped_rows", "omnimtp/spec_decode/proposer.py",
        "        if self.cache is not None:\n            keep_cache_rows(self.cache, rows)\n",
        "        pass\n",
        ("tests/test_spec_generate.py", "tests/test_adaptive_drafting.py", "tests/test_thinker_spec.py"),
        "the MTP head's draft cache keeps the rows its batch dropped",
    ),
    Mutation(
        "adaptive_thinker_drafter_skips_the_plain_steps_slots", "omnimtp/spec_decode/thinker_spec.py",
        "self._block = with_plain_steps(self._block, self._plain_steps, self.next_positions, kv_mask)",
        "self._block = with_plain_steps(self._block, self._plain_steps[-1:], self.next_positions, kv_mask)",
        ADAPTIVE, "the thinker's drafter reads only the newest slot after plain steps",
    ),
    Mutation(
        "adaptive_plain_step_keeps_its_position", "omnimtp/spec_decode/generate.py",
        "pending, next_position = token, next_position + 1",
        "pending, next_position = token, next_position",
        ADAPTIVE, "a plain step of a speculative run does not advance the pending token's position",
    ),
    Mutation(
        "adaptive_thinker_plain_step_keeps_the_old_pending_token", "omnimtp/spec_decode/thinker_spec.py",
        "        self._plain_steps.append((self.pending, next_ids, hidden))\n        self.pending = next_ids\n",
        "        self._plain_steps.append((self.pending, next_ids, hidden))\n",
        ADAPTIVE, "after a plain thinker step the next verify reads the token before the one just sampled",
    ),
    # --- speculative thinker steps ------------------------------------------------------------------
    Mutation(
        "prefix_reuse_ends_inside_a_block", "omnimtp/thinker.py",
        "        return common // self.block * self.block",
        "        return common",
        PREFIX_CACHE, "a warm turn reuses its prefix up to a position inside a prefill block (other forwards)",
    ),
    Mutation(
        "prefix_reuse_ignores_media_rows", "omnimtp/thinker.py",
        "        same &= (self.embeds[:num_rows] == embeds[:num_rows]).all(dim=-1).cpu()",
        "",
        PREFIX_CACHE, "a warm turn reuses cached audio rows behind the same placeholder ids whatever the audio",
    ),
    Mutation(
        "talker_prefix_reuse_ends_inside_a_block", "omnimtp/talker/loop.py",
        "        return common // self.block * self.block",
        "        return common",
        PREFIX_CACHE, "a warm turn reuses its talker prefix up to a row inside a prefill block (other forwards)",
    ),
    Mutation(
        "talker_user_rows_projected_in_one_call", "omnimtp/talker/qwen3_inputs.py",
        "        if block is not None and num_user + NUM_ASSISTANT_ROWS > block:",
        "        if False:",
        PREFIX_CACHE, "a long talker prefill's user rows are projected in one call (their bits depend on its length)",
    ),
    Mutation(
        "session_cache_weighs_thinker_prefixes_only", "omnimtp/engine/prefix_cache.py",
        "        return sum(part.num_bytes for part in (self.thinker, self.talker) if part is not None)",
        "        return sum(part.num_bytes for part in (self.thinker,) if part is not None)",
        ("tests/test_prefix_cache.py::test_talker_prefixes_count_in_the_budget_and_the_gauge",),
        "the session cache's budget and its bytes gauge leave out the talker prefixes it holds",
    ),
    Mutation(
        "thinker_spec_no_rollback", "omnimtp/thinker.py",
        "                self.kv.restore(tuple(lengths))\n",
        "",
        THINKER_SPEC, "the speculative thinker keeps the KV of rejected drafts",
    ),
    Mutation(
        "thinker_spec_hands_over_the_first_verify_row", "omnimtp/thinker.py",
        "i, token_id, embeds[r, j : j + 1], hidden[r, j : j + 1], self.finish_reasons[i], logprob",
        "i, token_id, embeds[r, j : j + 1], hidden[r, :1], self.finish_reasons[i], logprob",
        THINKER_SPEC, "every accepted token hands the talker the verify's first hidden row",
    ),
    Mutation(
        "thinker_draft_prefill_positions_without_rope_offsets", "omnimtp/thinker.py",
        "positions = [torch.arange(len(p), device=device) + self.kv.rope_offsets[i]"
        " for i, p in enumerate(self.prompts)]",
        "positions = [torch.arange(len(p), device=device) for i, p in enumerate(self.prompts)]",
        THINKER_DRAFTS,
        "the drafter reads an image prompt's prefill at cache indexes, not at the thinker's M-RoPE positions",
    ),
    Mutation(
        "thinker_draft_next_positions_one_short", "omnimtp/spec_decode/thinker_spec.py",
        "self.next_positions = self.next_positions + num_kept",
        "self.next_positions = self.next_positions + num_kept - 1",
        THINKER_DRAFTS, "the drafter's positions fall one further behind the thinker's each speculative step",
    ),
    Mutation(
        "thinker_draft_sampling_of_row_zero", "omnimtp/spec_decode/thinker_spec.py",
        "return params[0] if all(p == params[0] for p in params) else params",
        "return params[0]",
        THINKER_DRAFTS, "every row of a speculative run drafts with row 0's sampling",
    ),
    # --- Qwen2.5-Omni: talker and token2wav ----------------------------------------------------------
    Mutation(
        "qwen2_5_talker_eos_end_only", "omnimtp/talker/loop.py",
        "self.eos_ids = frozenset([config.tts_codec_end_token_id, config.tts_codec_pad_token_id])",
        "self.eos_ids = frozenset([config.tts_codec_end_token_id])",
        QWEN2_5, "Qwen2.5's talker stops on codec end only (codec pad is an EOS id too)",
    ),
    Mutation(
        "qwen2_5_next_input_without_reply_row", "omnimtp/talker/loop.py",
        "return code0[:, None], self.project(codec_embed + text)  # [R, 1], [R, H]",
        "return code0[:, None], self.project(codec_embed)  # [R, 1], [R, H]",
        QWEN2_5, "Qwen2.5's talker step drops the reply row from its next input",
    ),
    Mutation(
        "qwen2_5_mrope_sections_as_interleaved", "omnimtp/runtime/ops.py",
        "    if not is_interleaved:\n        return torch.cat(",
        "    if False:\n        return torch.cat(",
        QWEN2_5, "Qwen2.5's section M-RoPE is computed interleaved (Qwen3's layout)",
    ),
    Mutation(
        "token2wav_noise_scaled", "omnimtp/codec/token2wav.py",
        "        return torch.randn(shape, generator=generator, dtype=reference_mel.dtype,"
        " device=reference_mel.device)",
        "        return 0.5 * torch.randn(shape, generator=generator, dtype=reference_mel.dtype,"
        " device=reference_mel.device)",
        TOKEN2WAV, "the DiT's initial noise is not transformers' standard normal draw",
    ),
    Mutation(
        "token2wav_crossfade_reversed", "omnimtp/codec/token2wav.py",
        "stream.look_ahead_mel[:, :num_fade] * (1 - weight) + chunk_mel[:, :num_fade] * weight",
        "stream.look_ahead_mel[:, :num_fade] * weight + chunk_mel[:, :num_fade] * (1 - weight)",
        ("tests/test_token2wav.py",), "the crossfade at a chunk seam rises towards the old window instead of the new",
    ),
    # --- speech: talker loop ------------------------------------------------------------------------
    Mutation(
        "talker_tts_pad_instead_of_text_row", "omnimtp/talker/loop.py",
        "    return row.text_rows.pop(0) if row.text_rows else row.request.tts_pad_embed",
        "    if row.text_rows:\n        row.text_rows.pop(0)\n    return row.request.tts_pad_embed",
        TALKER, "the talker consumes the reply's text rows but adds tts_pad instead",
    ),
    Mutation(
        "talker_repetition_history_not_updated", "omnimtp/talker/loop.py",
        "        self.seen[index, self.code0[index]] = True\n",
        "",
        TALKER, "the repetition-penalty history never records generated codes",
    ),
    Mutation(
        "talker_residual_tables_shifted", "omnimtp/talker/loop.py",
        "zip(residual.unbind(1), self.codec_tables, strict=True)",
        "zip(residual.unbind(1), self.codec_tables[1:] + self.codec_tables[:1], strict=True)",
        TALKER, "the talker's next input embeds residual code j with table j+1",
    ),
    # --- code predictor -----------------------------------------------------------------------------
    Mutation(
        "cp_codec_embedding_index_minus_one", "omnimtp/talker/code_predictor.py",
        "positions[j], lm_heads[j], codec_embeddings[j], embed_sum",
        "positions[j], lm_heads[j], codec_embeddings[j - 1], embed_sum",
        CODE_PREDICTOR, "the runner embeds step j's code with codec_embedding[j-1]",
    ),
    Mutation(
        "cp_lm_head_off_by_one", "omnimtp/talker/code_predictor.py",
        "lm_heads[j], codec_embeddings[j], embed_sum, sampling,\n"
        "            None if noise is None else noise[:, j], gemm, packed_lm_heads[j],",
        "lm_heads[min(j + 1, len(lm_heads) - 1)], codec_embeddings[j], embed_sum, sampling,\n"
        "            None if noise is None else noise[:, j], gemm, packed_lm_heads[min(j + 1, len(lm_heads) - 1)],",
        CODE_PREDICTOR, "the runner predicts step j with lm_head[j+1] (plain, packed and quantized weights)",
    ),
    Mutation(
        "cp_noise_shared_across_rows", "omnimtp/talker/code_predictor.py",
        "noise = exponential_noise(noise_shape, None if generators is None else list(generators), self.device)",
        "noise = exponential_noise((1,) + noise_shape[1:], None if generators is None else list(generators)[:1],"
        " self.device).expand(noise_shape)",
        CODE_PREDICTOR, "every row of a frame uses the first row's sampling noise",
    ),
    Mutation(
        "cp_noise_shared_across_steps", "omnimtp/talker/code_predictor.py",
        "None if noise is None else noise[:, j], gemm",
        "None if noise is None else noise[:, 0], gemm",
        CODE_PREDICTOR, "every residual step of a frame reuses step 0's sampling noise",
    ),
    Mutation(
        "cp_next_talker_input_table_shifted", "omnimtp/talker/code_predictor.py",
        "embeds.append(cp.model.codec_embedding[j](residual_codes[:, j])[:, None])",
        "embeds.append(cp.model.codec_embedding[j - 1](residual_codes[:, j])[:, None])",
        ("tests/test_code_predictor.py",), "next_talker_input embeds residual code j with table j-1",
    ),
    # --- handoff ------------------------------------------------------------------------------------
    Mutation(
        "handoff_keeps_stop_row", "omnimtp/handoff.py",
        'drop = 1 if finish_reason == "stop" and num_output_tokens > 0 else 0',
        "drop = 0",
        HANDOFF, "the stop token's row reaches the talker",
    ),
    Mutation(
        "handoff_drops_two_rows_on_stop", "omnimtp/handoff.py",
        'drop = 1 if finish_reason == "stop" and num_output_tokens > 0 else 0',
        'drop = 2 if finish_reason == "stop" and num_output_tokens > 1 else 0',
        HANDOFF, "the stop-row trim is off by one (drops the last real row too)",
    ),
    Mutation(
        "handoff_drops_row_on_length", "omnimtp/handoff.py",
        'drop = 1 if finish_reason == "stop" and num_output_tokens > 0 else 0',
        "drop = 1 if num_output_tokens > 0 else 0",
        HANDOFF, "a request that hit max tokens also loses its last row",
    ),
    Mutation(
        "handoff_keeps_stop_id", "omnimtp/handoff.py",
        "output_ids[: target - num_prompt]]",
        "output_ids[: target - num_prompt + 1]]",
        HANDOFF, "the trimmed output ids keep the stop id",
    ),
    Mutation(
        "handoff_stream_releases_held_row", "omnimtp/handoff.py",
        "safe = self.builder.num_prompt_rows + max(self._num_tokens - 1, 0)",
        "safe = self.builder.num_prompt_rows + max(self._num_tokens, 0)",
        HANDOFF, "the streamed handoff releases the newest token's row before it knows it is not the stop row",
    ),
    # --- rejection sampler --------------------------------------------------------------------------
    Mutation(
        "rejection_resample_from_p", "omnimtp/spec_decode/rejection.py",
        "residual = (p_final - q_final).clamp(min=0.0)  # [B, V]",
        "residual = p_final.clone()  # [B, V]",
        REJECTION, "the recovered token is drawn from p instead of max(p - q, 0)",
    ),
    Mutation(
        "rejection_always_accept", "omnimtp/spec_decode/rejection.py",
        "accept_sampled = uniforms * q_draft < p_draft",
        "accept_sampled = uniforms >= 0",
        REJECTION, "every sampled draft is accepted",
    ),
    Mutation(
        "rejection_accept_min_1_q_over_p", "omnimtp/spec_decode/rejection.py",
        "accept_sampled = uniforms * q_draft < p_draft",
        "accept_sampled = uniforms * p_draft < q_draft",
        REJECTION, "a draft is accepted with probability min(1, q/p)",
    ),
    Mutation(
        "rejection_accept_with_p", "omnimtp/spec_decode/rejection.py",
        "accept_sampled = uniforms * q_draft < p_draft",
        "accept_sampled = uniforms < p_draft",
        REJECTION, "a draft is accepted with probability p(x) (q ignored)",
    ),
    Mutation(
        "rejection_bonus_not_emitted", "omnimtp/spec_decode/rejection.py",
        "    return tokens, num_accepted + 1",
        "    return tokens, (num_accepted + 1).clamp(max=num_draft)",
        REJECTION, "after k accepted drafts the bonus token is not emitted",
    ),
    Mutation(
        "rejection_bonus_from_last_draft_position", "omnimtp/spec_decode/rejection.py",
        "p_final = target_probs[rows, num_accepted].float()",
        "p_final = target_probs[rows, num_accepted.clamp(max=num_draft - 1)].float()",
        REJECTION, "the bonus token is drawn from p_k instead of p_{k+1}",
    ),
    Mutation(
        "rejection_noise_before_uniforms", "omnimtp/spec_decode/rejection.py",
        "        uniform_rows.append(torch.rand(num_draft, dtype=torch.float64, device=device, generator=g))\n"
        "        noise_rows.append(torch.empty(vocab_size, device=device).exponential_(generator=g))\n",
        "        noise_rows.append(torch.empty(vocab_size, device=device).exponential_(generator=g))\n"
        "        uniform_rows.append(torch.rand(num_draft, dtype=torch.float64, device=device, generator=g))\n",
        ("tests/test_rejection.py",),
        "a seeded row draws its Exp(1) noise before its uniforms (same law, other tokens)",
    ),
    # --- sampling filters ---------------------------------------------------------------------------
    Mutation(
        "sampling_top_p_before_top_k", "omnimtp/sampling.py",
        _TOP_K + _TOP_P, _TOP_P + _TOP_K, SAMPLING, "top-p is applied before top-k",
    ),
    # Temperature after top-k alone is no bug (top-k does not change under a positive scale); after top-p it is.
    Mutation(
        "sampling_temperature_after_top_p", "omnimtp/sampling.py",
        _TEMPERATURE + _TOP_K + _TOP_P, _TOP_K + _TOP_P + _TEMPERATURE, SAMPLING,
        "temperature is applied after top-k and top-p",
    ),
    Mutation(
        "sampling_top_k_keeps_one_more", "omnimtp/sampling.py",
        "kth = torch.topk(scores, k, dim=-1).values[..., -1:]",
        "kth = torch.topk(scores, min(k + 1, scores.shape[-1]), dim=-1).values[..., -1:]",
        SAMPLING, "top-k keeps k + 1 tokens",
    ),
    # --- speculative decoding: rollback and bonus ---------------------------------------------------
    Mutation(
        "spec_no_kv_rollback", "omnimtp/spec_decode/generate.py",
        "            target_cache.crop(block_width - (k + 1))",
        "            pass",
        SPEC, "the target's KV slots of rejected drafts are never cropped",
    ),
    Mutation(
        "spec_rollback_keeps_one_rejected_slot", "omnimtp/spec_decode/generate.py",
        "(offsets[None, :block_width] < num_kept[:, None])",
        "(offsets[None, :block_width] <= num_kept[:, None])",
        SPEC, "a row's first rejected draft stays visible in its kv_mask",
    ),
    Mutation(
        "packed_crop_off_by_one", "omnimtp/runtime/kv_cache.py",
        "self.lengths = [max(0, length + n) if n < 0 else min(n, length) for length in self.lengths]",
        "self.lengths = [max(0, length + n + 1) if n < 0 else min(n, length) for length in self.lengths]",
        SPEC, "the packed KV cache crops one slot too few",
    ),
    Mutation(
        "spec_greedy_bonus_not_emitted", "omnimtp/spec_decode/generate.py",
        "    return tokens, num_accepted + 1",
        "    return tokens, (num_accepted + 1).clamp(max=num_draft)",
        SPEC, "greedy verification drops the bonus token after k accepted drafts",
    ),
    Mutation(
        "spec_greedy_bonus_from_last_draft_position", "omnimtp/spec_decode/generate.py",
        "tokens[rows, num_accepted] = target_argmax[rows, num_accepted]",
        "tokens[rows, num_accepted] = target_argmax[rows, num_accepted.clamp(max=num_draft - 1)]",
        SPEC, "greedy verification emits argmax p_k as the bonus instead of argmax p_{k+1}",
    ),
    # --- rows of one batch ending at different steps ------------------------------------------------
    Mutation(
        "engine_request_budget_one_over", "omnimtp/engine/core.py",
        "len(request.output_ids) >= request.max_new_tokens",
        "len(request.output_ids) > request.max_new_tokens",
        ENGINE_ROWS, "a request of a cohort whose run allows more gets one token over its own budget",
    ),
    Mutation(
        "kv_keep_leaves_rope_offsets", "omnimtp/runtime/kv_cache.py",
        "        self.rope_offsets = [self.rope_offsets[s] for s in slots] + emptied\n",
        "",
        ENGINE_ROWS, "compacting the KV slots moves their lengths but not their M-RoPE offsets",
    ),
    Mutation(
        "seeds_talker_equals_thinker", "omnimtp/sampling.py",
        "thinker, talker = (2 * seed) % _UINT64, (2 * seed + 1) % _UINT64",
        "thinker, talker = (2 * seed) % _UINT64, (2 * seed) % _UINT64",
        ("tests/test_qwen2_5_omni.py::test_request_seeds_keep_thinker_and_talker_and_add_a_distinct_codec_seed",
         "tests/test_sampling.py"),
        "a request's talker generator is seeded as its thinker's (their draws coincide)",
    ),
    # --- media input ------------------------------------------------------------------------------------
    Mutation(
        "media_decode_ignores_rope_offsets", "omnimtp/packed_decoder.py",
        "            cache.rope_offsets[slot] = int(end) + 1 - (cache.lengths[slot] + num_new)",
        "            cache.rope_offsets[slot] = 0",
        MEDIA, "decoding after an image or video prompt continues at the cache index, not at its M-RoPE maximum + 1",
    ),
    Mutation(
        "media_no_deepstack", "omnimtp/runtime/decoder.py",
        "        if i < len(layer_adds):\n            x = x + layer_adds[i]",
        "        if False:\n            x = x + layer_adds[i]",
        MEDIA, "the deepstack visual features are never added",
    ),
    Mutation(
        "media_deepstack_first_level_only", "omnimtp/runtime/decoder.py",
        "        if i < len(layer_adds):\n            x = x + layer_adds[i]",
        "        if i < min(len(layer_adds), 1):\n            x = x + layer_adds[i]",
        MEDIA, "only the first deepstack level is added (levels 2..n are dropped)",
    ),
    Mutation(
        "media_talker_flat_positions", "omnimtp/talker/qwen3_inputs.py",
        "        if media is None or not media.has_vision:\n            return None",
        "        if True:\n            return None",
        MEDIA, "the talker prefill of an image or video prompt gets 1-D positions",
    ),
    Mutation(
        "media_audio_rows_not_scattered", "omnimtp/thinker.py",
        "        embeds = _scatter(embeds, ids == config.audio_token_id, audio, \"audio\")",
        "        _scatter(embeds, ids == config.audio_token_id, audio, \"audio\")",
        MEDIA, "the audio encoder's rows never reach the prompt embeddings",
    ),
    Mutation(
        "media_video_seconds_per_grid_default_one", "omnimtp/media.py",
        "return torch.full((self.video_grid_thw.shape[0],), float(temporal_patch_size))",
        "return torch.full((self.video_grid_thw.shape[0],), 1.0)",
        MEDIA, "a video without video_second_per_grid gets 1.0 seconds per grid step, not temporal_patch_size",
    ),
    # --- speculative decoding on hybrid targets ---------------------------------------------------------
    Mutation(
        "hybrid_no_rollback", "omnimtp/spec_decode/generate.py",
        "        if saved_states is not None:\n"
        "            rollback(target, target_cache, saved_states, layer_inputs, num_kept)",
        "        if False:\n            rollback(target, target_cache, saved_states, layer_inputs, num_kept)",
        HYBRID, "rejected drafts stay in the Gated-DeltaNet recurrent and conv states",
    ),
    # --- Qwen3-TTS ------------------------------------------------------------------------------------
    Mutation(
        "peer_converter_swaps_q_and_k_norms", "benchmarks/qwentts_peer.py",
        '"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",',
        '"self_attn.q_norm.weight": "attn_k_norm.weight", "self_attn.k_norm.weight": "attn_q_norm.weight",',
        QWENTTS_PEER, "the qwentts.cpp converter writes each layer's q norm under the k norm's name and back",
    ),
    Mutation(
        "peer_converter_embeddings_in_q4_k", "benchmarks/qwentts_peer.py",
        'return GGML_Q6_K if (".codec_embd" in name or ".text_embd" in name) else GGML_Q4_K',
        "return GGML_Q4_K",
        QWENTTS_PEER, "the qwentts.cpp converter's Q4_K_M stores the embedding tables in Q4_K (its tool: Q6_K)",
    ),
    Mutation(
        "tts_no_speaker_row", "omnimtp/families/qwen3_tts.py",
        "        if voice.speaker_id is not None:\n",
        "        if False:\n",
        QWEN3_TTS, "the CustomVoice speaker row is left out of the talker prefill",
    ),
    Mutation(
        "tts_no_language_row", "omnimtp/families/qwen3_tts.py",
        "        if voice.language_id is None:\n",
        "        if True:\n",
        QWEN3_TTS, "the language row is never written (every request speaks as auto)",
    ),
    Mutation(
        "tts_no_dialect", "omnimtp/families/qwen3_tts.py",
        '        if dialect and key in (AUTO_LANGUAGE, "chinese"):',
        "        if False:",
        QWEN3_TTS, "a dialect speaker's Chinese or auto request does not get its dialect's language row",
    ),
    Mutation(
        "tts_drops_instructions", "omnimtp/families/qwen3_tts.py",
        "        rows = [] if voice.instruct_ids is None else",
        "        rows = [] if True else",
        QWEN3_TTS, "the instructions' user turn is left out of the prefill",
    ),
    Mutation(
        "tts_trailing_text_off_by_one", "omnimtp/families/qwen3_tts.py",
        "trailing = torch.cat([self.speech_text_rows(text[0, 1:].tolist()), eos[0]])",
        "trailing = torch.cat([self.speech_text_rows(text[0, 2:].tolist()), eos[0]])",
        QWEN3_TTS, "the trailing text skips the second text token",
    ),
    Mutation(
        "speech_stream_pads_instead_of_waiting", "omnimtp/talker/loop.py",
        "return self.finish_reason is None and (bool(self.text_rows) or self.is_text_finished)",
        "return self.finish_reason is None",
        SPEECH_STREAM, "a talker row whose next text row has not arrived steps on tts_pad instead of waiting",
    ),
    Mutation(
        "streamed_ids_commit_the_last_piece", "omnimtp/tokenizer.py",
        "        return cut, offsets[before][0]\n",
        "        return held, offsets[before][0]\n",
        SPEECH_STREAM, "streamed text commits the ids of its last piece, which later text can still change",
    ),
    Mutation(
        "streamed_ids_lose_their_left_context", "omnimtp/tokenizer.py",
        '            context = (self._context if last_start == 0 else "") + self._pending[last_start:cut]\n',
        '            context = ""\n',
        SPEECH_STREAM, "held text is encoded alone: a whole-word added token matches after a letter or digit",
    ),
    Mutation(
        "streamed_ids_ignore_added_tokens", "omnimtp/tokenizer.py",
        "                held = start\n",
        "                held = len(text)\n",
        SPEECH_STREAM, "streamed text commits the start of what may become a special token",
    ),
    Mutation(
        "speech_stream_speaks_the_template_tail", "omnimtp/handoff.py",
        "spoken = len(self.ids) - (len(self.closing_ids) if self.is_finished else 0)",
        "spoken = len(self.ids)",
        SPEECH_STREAM, "a streamed Qwen3-TTS text speaks its template's closing ids",
    ),
    Mutation(
        "speech_stream_projects_rows_together", "omnimtp/families/qwen3_tts.py",
        "return torch.cat([self._text_rows(torch.tensor([[token]], device=self.device))[0] for token in ids])",
        "return self._text_rows(torch.tensor([ids], device=self.device))[0]",
        SPEECH_STREAM, "float Qwen3-TTS projects the trailing rows in one call, so a split text gets other bits",
    ),
    Mutation(
        "tts_predictor_projects_once", "omnimtp/talker/code_predictor.py",
        "        step_input = _project(w, embed[:, None])  # [R, 1, H]",
        "        step_input = embed[:, None] @ torch.eye(embed.shape[-1], w.decoder.hidden_size, dtype=embed.dtype)",
        QWEN3_TTS, "the code predictor's small_to_mtp_projection is applied to its first step only",
    ),
    Mutation(
        "tts_greedy_without_repetition_penalty", "omnimtp/families/qwen3_tts.py",
        "QWEN3_TTS_TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.05)",
        "QWEN3_TTS_TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0)",
        QWEN3_TTS, "greedy requests drop the reference's repetition penalty 1.05",
    ),
    Mutation(
        "talker_repetition_penalty_ignored", "omnimtp/talker/loop.py",
        "apply_repetition_penalty(logits[i : i + 1], seen[i : i + 1], sampling.repetition_penalty)",
        "apply_repetition_penalty(logits[i : i + 1], seen[i : i + 1], 1.0)",
        QWEN3_TTS, "the talker ignores the request's repetition penalty",
    ),
    Mutation(
        "talker_no_suppression", "omnimtp/talker/loop.py",
        '            scores = scores.masked_fill(self.frames.is_suppressed, float("-inf"))  # [1, V]',
        "            scores = scores  # [1, V]",
        QWEN3_TTS, "the talker samples the suppressed top 1024 codec ids",
    ),
    Mutation(
        "tts_no_min_new_tokens", "omnimtp/families/qwen3_tts.py",
        "MIN_NEW_TOKENS = 2",
        "MIN_NEW_TOKENS = 0",
        QWEN3_TTS, "codec EOS may end a request before its second talker token",
    ),
    # --- voice cloning (Qwen3-TTS Base) -------------------------------------------------------------
    Mutation(
        "clone_x_vector_not_used", "omnimtp/families/qwen3_tts.py",
        "        elif voice.clone is not None:  # the x-vector is the speaker row\n",
        "        elif False:\n",
        VOICE_CLONE, "a cloned voice's x-vector is left out of the prompt",
    ),
    Mutation(
        "clone_icl_without_code_rows", "omnimtp/families/qwen3_tts.py",
        "        codec_rows = torch.cat([self._codec_rows([config.codec_bos_id]), frames[None]], dim=1)"
        "  # [1, T + 1, H]",
        "        codec_rows = torch.cat([self._codec_rows([config.codec_bos_id]), 0 * frames[None]], dim=1)",
        VOICE_CLONE, "the in-context prompt drops the reference codes' embeddings",
    ),
    Mutation(
        "clone_icl_without_transcript", "omnimtp/families/qwen3_tts.py",
        "self._text_rows(torch.cat([ref_text_ids, text], dim=-1))",
        "self._text_rows(text)",
        VOICE_CLONE, "the in-context prompt leaves out the reference transcript",
    ),
    Mutation(
        "clone_mel_fmax_wrong", "omnimtp/models/speaker_encoder.py",
        "F_MAX = 12_000.0", "F_MAX = 8_000.0",
        VOICE_CLONE, "the speaker encoder's mel filters stop at 8 kHz instead of 12 kHz",
    ),
    Mutation(
        "clone_mel_no_log_floor", "omnimtp/models/speaker_encoder.py",
        "torch.log(torch.clamp(mel, min=1e-5))", "torch.log(mel + 1e-5)",
        VOICE_CLONE, "the log-mel adds its floor instead of clamping to it",
    ),
    Mutation(
        "clone_icl_stream_not_primed", "omnimtp/families/qwen3_tts.py",
        "            self.codec.decode_streams([stream], [clone.ref_codes], [False])\n",
        "            pass\n",
        VOICE_CLONE, "an in-context clone's audio is decoded without the reference codes as left context",
    ),
    Mutation(
        "clone_encoder_drops_first_frame", "omnimtp/codec/speech_encoder.py",
        "        return codes[:, : math.ceil(audio.shape[0] / self.samples_per_frame)].to(\"cpu\", torch.int64)",
        "        return codes.to(\"cpu\", torch.int64)[:, 1:]",
        VOICE_CLONE, "the reference codes lose their first frame",
    ),
    Mutation(
        "clone_encoder_drops_partial_last_frame", "omnimtp/codec/speech_encoder.py",
        "        return codes[:, : math.ceil(audio.shape[0] / self.samples_per_frame)].to(\"cpu\", torch.int64)",
        "        return codes[:, : audio.shape[0] // self.samples_per_frame].to(\"cpu\", torch.int64)",
        VOICE_CLONE, "reference audio loses its partial last frame (Mimi's encode keeps it)",
    ),
    # --- /v1/realtime -------------------------------------------------------------------------------
    Mutation(
        "realtime_item_audio_rate_ignored", "omnimtp/server/routes/realtime/conversation.py",
        'audio = await heard_audio(state, pcm, state.settings.input_rate, f"{param}.audio")',
        'audio = await heard_audio(state, pcm, PCM_RATE, f"{param}.audio")',
        REALTIME, "an input_audio item is read as 24 kHz whatever rate the session names",
    ),
    Mutation(
        "realtime_cancel_any_response_id", "omnimtp/server/routes/realtime/responses.py",
        "    if event.response_id is not None and event.response_id != state.response_id:",
        "    if False:",
        REALTIME, "response.cancel naming another response cancels the active one",
    ),
    Mutation(
        "realtime_forgets_earlier_turns", "omnimtp/server/routes/realtime/responses.py",
        "(item.role, item.content) for item in state.items)",
        "(item.role, item.content) for item in state.items[-1:])",
        REALTIME, "a response answers only the conversation's last item, not its earlier turns",
    ),
    Mutation(
        "realtime_input_rate_ignored", "omnimtp/server/routes/realtime/formats.py",
        "    return audio_format.type, audio_format.rate or PCM_RATE",
        "    return audio_format.type, PCM_RATE",
        REALTIME, "input audio is read as 24 kHz whatever rate the session names (no resampling)",
    ),
    Mutation(
        "vad_silence_duration_ignored", "omnimtp/server/vad.py",
        "        self._silence_samples = VAD_RATE * config.silence_duration_ms / 1000",
        "        self._silence_samples = 0",
        VOICE_AGENT, "speech stops at its first silent window, whatever silence_duration_ms says",
    ),
    Mutation(
        "vad_barge_in_ignored", "omnimtp/server/routes/realtime/turns.py",
        "            if config.interrupt_response:",
        "            if False:",
        VOICE_AGENT, "speech during a response does not cancel it",
    ),
    Mutation(
        "truncate_keeps_the_transcript", "omnimtp/server/routes/realtime/conversation.py",
        "        item.text_deltas = item.text_deltas[:heard_frames]",
        "        item.text_deltas = item.text_deltas",
        VOICE_AGENT, "a truncated reply's unheard transcript stays in the conversation",
    ),
    Mutation(
        "truncate_ignores_word_timestamps", "omnimtp/server/routes/realtime/conversation.py",
        "    if item.words is not None:  # cut after the last word spoken whole before audio_end_ms",
        "    if False:",
        REALTIME_WORDS, "a truncated reply with word timestamps is cut by frames, not after its last heard word",
    ),
    Mutation(
        "realtime_reply_waits_for_its_words", "omnimtp/server/routes/realtime/state.py",
        "        self.stopped.set()",
        "        pass",
        REALTIME_WORDS, "a response stopped while its reply is aligned waits for the aligner before response.done",
    ),
    Mutation(
        "realtime_words_not_the_aligners", "omnimtp/server/routes/realtime/responses.py",
        "aligner.align((audio, state.context.engine.sample_rate), text, None))",
        "aligner.align((audio, 16000), text, None))",
        REALTIME_WORDS, "a spoken reply's words are aligned on its audio read at the wrong rate",
    ),
    Mutation(
        "g711_output_is_mu_law_always", "omnimtp/server/routes/realtime/formats.py",
        "        return base64.b64encode(g711_encode(pcm, self.fmt)).decode(\"ascii\")",
        "        return base64.b64encode(g711_encode(pcm, \"audio/pcmu\")).decode(\"ascii\")",
        VOICE_AGENT, "A-law output is encoded as μ-law",
    ),
    Mutation(
        "session_items_unbounded", "omnimtp/server/routes/realtime/conversation.py",
        "    if len(state.items) + num_items > limits.max_session_items:",
        "    if False:",
        VOICE_AGENT, "a realtime conversation grows past --max-session-items",
    ),
    Mutation(
        "realtime_cancel_ignored", "omnimtp/server/routes/realtime/responses.py",
        "    state.stop_response(\"client_cancelled\")  # its event stream ends; `_respond` reports it cancelled",
        "    pass",
        REALTIME, "response.cancel leaves the response running to its end",
    ),
    Mutation(
        "vad_create_response_ignored", "omnimtp/server/routes/realtime/turns.py",
        "        if config.create_response and state.response is None and state.settings.type == \"realtime\":",
        "        if state.response is None and state.settings.type == \"realtime\":",
        ("tests/test_realtime_vad.py::test_create_response_false_commits_the_turn_and_starts_no_response",),
        "a turn the server VAD commits starts a response under create_response: false",
    ),
    Mutation(
        "vad_interrupt_response_ignored", "omnimtp/server/routes/realtime/turns.py",
        "            if config.interrupt_response:",
        "            if True:",
        ("tests/test_realtime_vad.py::test_interrupt_response_false_leaves_the_response_running",),
        "speech during a response cancels it under interrupt_response: false",
    ),
    Mutation(
        "vad_silence_kept_between_turns", "omnimtp/server/routes/realtime/turns.py",
        "    if not turns.detector.is_speaking:  # keep the prefix padding",
        "    if False:  # keep the prefix padding",
        ("tests/test_realtime_vad.py::test_long_silence_under_vad_never_fills_the_buffer",),
        "the silence between turns stays in the input buffer until it is full (input_audio_buffer_full)",
    ),
    Mutation(
        "vad_clear_keeps_the_turn_in_progress", "omnimtp/server/routes/realtime/state.py",
        "        if turns.detector is not None:\n            turns.detector.restart()",
        "        if False:\n            turns.detector.restart()",
        ("tests/test_realtime_vad.py::test_clearing_the_buffer_mid_speech_resets_the_detector",),
        "input_audio_buffer.clear mid-speech leaves the detector inside the cleared speech",
    ),
    Mutation(
        "vad_restart_scores_the_cleared_tail", "omnimtp/server/vad.py",
        "        if self._resampler is not None:\n"
        "            tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)\n"
        "            self._resampler = self._new_resampler()\n"
        "            self._num_scored += len(tail)\n"
        "        self._num_scored += len(self._pending)\n        self._pending = self._pending[:0]\n",
        "",
        ("tests/test_realtime_vad.py::test_clearing_the_buffer_mid_speech_resets_the_detector",),
        "the cleared audio's unscored tail (the resampler's delay, a partial window) starts a phantom turn after "
        "input_audio_buffer.clear",
    ),
    Mutation(
        "vad_turn_detection_update_ignored", "omnimtp/server/routes/realtime/settings.py",
        "    if state.settings.turn_detection != settings.turn_detection or state.settings.input_rate != "
        "settings.input_rate:",
        "    if state.settings.input_rate != settings.input_rate:",
        ("tests/test_realtime_vad.py::test_a_session_update_between_turns_takes_effect_and_the_end_is_the_silence_after_the_speech",),
        "a session.update of turn_detection between turns keeps the detector of the old settings",
    ),
    Mutation(
        "vad_input_rate_update_ignored", "omnimtp/server/routes/realtime/settings.py",
        "    if state.settings.turn_detection != settings.turn_detection or state.settings.input_rate != "
        "settings.input_rate:",
        "    if state.settings.turn_detection != settings.turn_detection:",
        ("tests/test_realtime_vad.py::test_a_session_update_between_turns_takes_effect_and_the_end_is_the_silence_after_the_speech",),
        "a session.update of the input rate between turns keeps the detector resampling from the old rate",
    ),
    Mutation(
        "vad_end_is_the_prefix_padding_after_the_speech", "omnimtp/server/routes/realtime/turns.py",
        "turns.sample(event.sample, rate) + config.silence_duration_ms * rate // 1000)",
        "turns.sample(event.sample, rate) + config.prefix_padding_ms * rate // 1000)",
        ("tests/test_realtime_vad.py::test_a_session_update_between_turns_takes_effect_and_the_end_is_the_silence_after_the_speech",),
        "speech_stopped's audio_end_ms is prefix_padding_ms after the speech, not silence_duration_ms",
    ),
    Mutation(
        "vad_exit_threshold_not_silero_s", "omnimtp/server/vad.py",
        "        self._exit_threshold = max(config.threshold - 0.15, 0.01)",
        "        self._exit_threshold = max(config.threshold - 0.1, 0.01)",
        ("tests/test_realtime_vad.py::test_the_exit_rule_is_silero_s_on_scripted_scores",),
        "speech ends at scores under threshold - 0.1, not silero's threshold - 0.15",
    ),
    Mutation(
        "vad_exit_threshold_unfloored", "omnimtp/server/vad.py",
        "        self._exit_threshold = max(config.threshold - 0.15, 0.01)",
        "        self._exit_threshold = config.threshold - 0.15",
        ("tests/test_realtime_vad.py::test_the_exit_rule_is_silero_s_on_scripted_scores",),
        "under a threshold of 0.15 or less speech never ends (silero's exit threshold is at least 0.01)",
    ),
    Mutation(
        "truncate_at_the_whole_duration_refused", "omnimtp/server/routes/realtime/conversation.py",
        "    if event.audio_end_ms > duration_ms:",
        "    if event.audio_end_ms >= duration_ms:",
        ("tests/test_realtime_vad.py::test_truncate_cuts_the_reply_to_what_was_heard",),
        "conversation.item.truncate at exactly the item's duration is refused",
    ),
    Mutation(
        "g711_laws_swapped", "omnimtp/server/audio.py",
        'G711_CODECS = {"audio/pcmu": "pcm_mulaw", "audio/pcma": "pcm_alaw"}',
        'G711_CODECS = {"audio/pcmu": "pcm_alaw", "audio/pcma": "pcm_mulaw"}',
        ("tests/test_realtime_vad.py::test_g711_code_words_are_the_standard_s",),
        "audio/pcmu is decoded as A-law and audio/pcma as μ-law",
    ),
    Mutation(
        "g711_encoder_laws_swapped", "omnimtp/server/audio.py",
        '    if fmt == "audio/pcmu":\n        biased',
        '    if fmt == "audio/pcma":\n        biased',
        ("tests/test_realtime_vad.py::test_g711_code_words_are_the_standard_s",),
        "audio/pcmu is encoded as A-law and audio/pcma as μ-law (decoded as named)",
    ),
    Mutation(
        "g711_negative_samples_negated", "omnimtp/server/audio.py",
        "    magnitude = np.where(samples < 0, ~samples, samples)",
        "    magnitude = np.where(samples < 0, -samples, samples)",
        ("tests/test_realtime_vad.py::test_g711_code_words_are_the_standard_s",),
        "a negative sample is encoded by its negation, not its one's complement as G.191's reference encoder does",
    ),
    # --- request limits ---------------------------------------------------------------------------
    Mutation(
        "body_limit_off_by_one", "omnimtp/server/guard.py",
        "    if num_received > max_body_bytes:\n        raise too_large",
        "    if num_received >= max_body_bytes:\n        raise too_large",
        SERVER_HARDENING, "a body of exactly --max-body-bytes is refused with a 413",
    ),
    Mutation(
        "streamed_text_limit_off_by_one", "omnimtp/server/routes/speech_stream.py",
        "    if speech.num_chars + len(delta) > MAX_SPEECH_INPUT_CHARS:",
        "    if speech.num_chars + len(delta) >= MAX_SPEECH_INPUT_CHARS:",
        SPEECH_STREAM, "a streamed text of exactly the character limit is refused",
    ),
    Mutation(
        "json_containers_not_counted", "omnimtp/server/guard.py",
        "    if num_containers > MAX_JSON_CONTAINERS:",
        "    if False:",
        SERVER_STRUCTURE, "millions of tiny JSON values are parsed and validated before any limit refuses them",
    ),
    Mutation(
        "json_array_length_unchecked", "omnimtp/server/guard.py",
        "            if len(item) > MAX_JSON_ARRAY_ITEMS:",
        "            if False:",
        SERVER_STRUCTURE, "an over-long JSON array reaches the schema instead of a 400 naming its path",
    ),
    Mutation(
        "speech_batch_whitespace_item_not_refused", "omnimtp/server/routes/speech.py",
        "            if not item.input.strip():",
        "            if not item.input:",
        ("tests/test_audio_formats.py::test_a_whitespace_item_is_its_own_400_and_an_item_cut_at_max_frames_says_"
         "length",),
        "a whitespace-only item of /v1/audio/speech/batch reaches the engine instead of being that item's 400",
    ),
    Mutation(
        "speech_batch_item_finish_reason_always_stop", "omnimtp/server/routes/speech.py",
        '"response_format": item.response_format, "finish_reason": final.finish_reason,',
        '"response_format": item.response_format, "finish_reason": "stop",',
        ("tests/test_audio_formats.py::test_a_whitespace_item_is_its_own_400_and_an_item_cut_at_max_frames_says_"
         "length",),
        "a batch item cut at max_frames says finish_reason stop",
    ),
    Mutation(
        "playground_assets_without_the_page_headers", "omnimtp/server/routes/playground.py",
        "    return Response(_read(name), media_type=_FILES[name], headers=_HEADERS)",
        "    return Response(_read(name), media_type=_FILES[name])",
        ("tests/test_playground.py::test_the_page_and_its_files_are_served_and_can_be_turned_off",),
        "the playground's script and style go out without nosniff, no-cache and the CSP the page has",
    ),
    Mutation(
        "json_arrays_not_counted", "omnimtp/server/guard.py",
        '    num_containers = text.count("{") + text.count("[")',
        '    num_containers = text.count("{")',
        ("tests/test_server_structure.py::test_arrays_count_as_containers",),
        "JSON arrays do not count against MAX_JSON_CONTAINERS: 100,000 short arrays are parsed",
    ),
    Mutation(
        "omni_speech_sampling_ignored", "omnimtp/server/routes/common.py",
        '        if self.engine.has_chat:\n            for name in ("top_p", "top_k"):',
        '        if False:\n            for name in ("top_p", "top_k"):',
        SERVER, "a Qwen3-Omni speech request's temperature, top_p and top_k are silently ignored",
    ),
    Mutation(
        "streamed_text_positions_unchecked", "omnimtp/server/routes/speech_stream.py",
        "        if text.strip():\n            context.engine.check_speech_text(text, \"delta\")",
        "        if False:\n            context.engine.check_speech_text(text, \"delta\")",
        SPEECH_STREAM, "a streamed text over the prompt-token limit is taken",
    ),
    # --- long texts spoken in segments --------------------------------------------------------------
    Mutation(
        "streamed_text_never_cut", "omnimtp/families/text.py",
        "taken.append((self._ids.push(spoken[self._num_fed:]) + self._ids.finish(), True))",
        "taken.append((self._ids.push(spoken[self._num_fed:]) + self._ids.finish(), False))",
        ("tests/test_long_speech.py::test_a_streamed_long_text_is_the_whole_texts_speech_however_it_is_split",),
        "a streamed text's segments run together into one talker run (its ids are not those of the whole text)",
    ),
    Mutation(
        "open_segment_overclaims", "omnimtp/text_segments.py",
        "                yield OpenSegment(current + piece, len(current))",
        "                yield OpenSegment(current + piece, len(current + piece))",
        LONG_SPEECH, "a sentence still being written is spoken in a segment it may not fit",
    ),
    Mutation(
        "streamed_segment_cut_short_ends_the_request", "omnimtp/engine/core.py",
        "            if ids is not None or request.may_have_next_segment:",
        "            if ids is not None:",
        ("tests/test_long_speech.py::test_a_segment_whose_talker_ends_early_skips_the_rest_of_its_text",),
        "a streamed text's request ends when a segment's talker ends early, though more segments follow",
    ),
    Mutation(
        "long_text_cut_without_sentences", "omnimtp/text_segments.py",
        "return _split(text, 0, max_size, size) if text else iter(())",
        "return _split(text, 1, max_size, size) if text else iter(())",
        LONG_SPEECH, "a long text is cut at clause marks and words, never first at sentence ends",
    ),
    Mutation(
        "long_text_segment_fresh_codec", "omnimtp/engine/core.py",
        "            request.prompt_ids.extend(int(token) for token in ids)\n",
        "            request.prompt_ids.extend(int(token) for token in ids)\n"
        "        request.codec_stream = self.family.new_codec_stream(request.speaker, request.codec_generator)\n",
        LONG_SPEECH, "each segment's codes are decoded without the previous segment's left context (a seam)",
    ),
    Mutation(
        "long_text_first_segment_only", "omnimtp/engine/core.py",
        "            if ids is not None or request.may_have_next_segment:\n"
        "                self._next_segment(request, ids or [])",
        "            if False:\n                self._next_segment(request, ids or [])",
        LONG_SPEECH, "a long text's request ends after its first segment",
    ),
    Mutation(
        "whitespace_done_keeps_its_slot", "omnimtp/server/routes/speech_stream.py",
        "                        speech.sender.cancel()\n                        speech.handle.cancel()\n",
        "",
        SPEECH_STREAM, "a whitespace-only text ended with input_text.done keeps its request and slot",
    ),
    Mutation(
        "parked_request_holds_a_slot", "omnimtp/engine/core.py",
        "return self.config.max_batch_size - sum(not r.is_parked for r in self.running.values())",
        "return self.config.max_batch_size - len(self.running)",
        ("tests/test_speech_stream.py::test_requests_waiting_for_text_hold_no_slot",
         "tests/test_speech_stream.py::test_sessions_trickling_text_do_not_hold_up_a_plain_request"),
        "a speech request waiting for more text still counts against max_batch_size",
    ),
    Mutation(
        "failed_step_drops_parked_requests", "omnimtp/engine/core.py",
        "            failed = list(self.running.values())\n",
        "            failed = [r for r in self.running.values() if not r.is_parked]\n",
        ("tests/test_speech_stream.py::test_a_failed_step_fails_parked_requests_too",),
        "a step that raises fails the running requests but forgets the parked ones (their clients wait forever)",
    ),
    Mutation(
        "textless_request_admitted", "omnimtp/engine/core.py",
        "        waiting = [r for r in self.waiting if r.has_text]\n",
        "        waiting = list(self.waiting)\n",
        ("tests/test_speech_stream.py::test_requests_waiting_for_text_hold_no_slot",),
        "a streamed-text speech request is admitted into a slot before it has any text id",
    ),
    Mutation(
        "parked_talker_forgets_its_seen_codes", "omnimtp/talker/loop.py",
        "self._merge([parked.row], parked.last_hidden[None], parked.code0[None], parked.seen[None])",
        "self._merge([parked.row], parked.last_hidden[None], parked.code0[None], parked.seen[None] & False)",
        SPEECH_STREAM, "a resumed talker row loses the codes its repetition penalty has seen",
    ),
    Mutation(
        "text_idle_timeout_never_fires", "omnimtp/server/scheduler.py",
        "        return [request_id for deadline, request_id in self._text_waits() if deadline <= now]",
        "        return []",
        ("tests/test_speech_stream.py::test_a_session_silent_past_the_text_timeout_ends_its_request",),
        "a streamed-text request waiting for text past --timeout-text-idle is never ended",
    ),
    Mutation(
        "text_idle_timeout_is_a_server_error", "omnimtp/server/routes/speech_stream.py",
        'type="invalid_request_error" if is_timeout else "server_error"',
        'type="server_error"',
        ("tests/test_speech_stream.py::test_a_session_silent_past_the_text_timeout_ends_its_request",),
        "the text-idle timeout's error event says server_error, though the client's pause caused it",
    ),
    Mutation(
        "parked_request_holds_back_background_work", "omnimtp/engine/core.py",
        "r.first_audio_at is None and not r.is_parked\n",
        "r.first_audio_at is None\n",
        ("tests/test_speech_stream.py::test_a_request_parked_before_its_first_audio_does_not_hold_back_background_"
         "work",),
        "a request parked (waiting for text) before its first audio keeps background requests out of the engine",
    ),
    Mutation(
        "error_location_keeps_union_tags", "omnimtp/server/errors.py",
        "        loc = [part for part in loc if not (isinstance(part, str) and _UNION_TAG.fullmatch(part))]",
        "        loc = list(loc)",
        REALTIME, "an error inside a union names pydantic's member tag (session.max_output_tokens.constrained-int)",
    ),
    Mutation(
        "engine_argument_name_in_the_message", "omnimtp/server/routes/voices.py",
        "        message = param + message[len(name):]  # the field the client sent, not the engine's argument",
        "        message = message",
        SERVER_VOICES, "a voice upload's error message names ref_audio, not the audio_sample the client sent",
    ),
    Mutation(
        "error_events_echo_whole_values", "omnimtp/server/websocket.py",
        "    if len(value) <= MAX_ECHO_CHARS:",
        "    if True:",
        REALTIME, "an error event repeats a megabyte-long event type whole",
    ),
    # --- saved voices -----------------------------------------------------------------------------
    Mutation(
        "voice_name_allows_slash", "omnimtp/server/voice_store.py",
        'NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_NAME_LENGTH - 1}}}")',
        'NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_/.-]{{0,{MAX_NAME_LENGTH - 1}}}")',
        VOICE_STORE, "a voice name may hold '/' and '.' (a path)",
    ),
    Mutation(
        "voice_insert_outside_the_transaction", "omnimtp/server/voice_store.py",
        '                conn.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)\n',
        '                conn.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)\n'
        '                conn.execute("COMMIT")\n'
        '                conn.execute("BEGIN IMMEDIATE")\n',
        VOICE_STORE, "a voice is committed before its transaction ends (a crash after it keeps the voice)",
    ),
    Mutation(
        "voice_deferred_transaction", "omnimtp/server/voice_store.py",
        'conn.execute("BEGIN IMMEDIATE")  # the write lock before the count and the name check',
        'conn.execute("BEGIN")  # the write lock before the count and the name check',
        VOICE_STORE, "an add counts and checks names before it holds the write lock",
    ),
    Mutation(
        "voice_limit_off_by_one", "omnimtp/server/voice_store.py",
        "                if count >= self.max_voices:",
        "                if count > self.max_voices:",
        VOICE_STORE, "the store holds one voice more than max_voices",
    ),
    Mutation(
        "voice_add_commits_on_error", "omnimtp/server/voice_store.py",
        '            except BaseException:\n                if conn.in_transaction:\n'
        '                    conn.execute("ROLLBACK")',
        '            except BaseException:\n                if conn.in_transaction:\n'
        '                    conn.execute("COMMIT")',
        VOICE_STORE, "an exception inside an add's transaction commits the voice instead of rolling it back",
    ),
    Mutation(
        "voice_file_drops_metadata", "omnimtp/voice.py",
        'seconds=float(meta.get("seconds", 0)),\n                       created=float(meta.get("created", 0)), '
        'info=json.loads(meta.get("info", "{}")))',
        'seconds=0.0,\n                       created=0.0, info={})',
        VOICE_STORE, "a voice loaded from a file or bytes loses its seconds, created and info",
    ),
    Mutation(
        "clone_fields_on_any_model", "omnimtp/server/routes/voices.py",
        '    if context.engine.tts_model_type != "base":\n        if clone:',
        '    if context.engine.tts_model_type != "base":\n        if False:',
        SERVER_VOICES, "a CustomVoice model ignores the Base-only clone fields instead of refusing them",
    ),
    Mutation(
        "voices_routes_without_the_key", "omnimtp/server/guard.py",
        'if self.api_key is not None and path.startswith("/v1/") and not self._is_authorized(scope):',
        'if self.api_key is not None and path.startswith("/v1/") and not path.startswith("/v1/audio/voices") '
        'and not self._is_authorized(scope):',
        SERVER_VOICES, "the voices routes answer without the API key",
    ),
    Mutation(
        "saved_voice_x_vector_only_ignored", "omnimtp/server/routes/voices.py",
        "        if body.x_vector_only_mode:\n            voice = voice.x_vector_only()",
        "        if body.x_vector_only_mode:\n            voice = voice",
        SERVER_VOICES, "x_vector_only_mode is ignored with a saved in-context voice",
    ),
    # --- transcription ---------------------------------------------------------------------------------
    Mutation(
        "background_thinks_before_first_audio", "omnimtp/engine/core.py",
        "            if not (is_first_audio_due and (cohort.is_background or self._is_ahead(cohort))):",
        "            if not (is_first_audio_due and self._is_ahead(cohort)):",
        TRANSCRIPTION, "a background transcript thinks while a response still waits for its first audio",
    ),
    Mutation(
        "transcription_language_ignored", "omnimtp/families/text.py",
        'instruction = f"Transcribe the {name} audio into text." if name else "Transcribe the audio into text."',
        'instruction = "Transcribe the audio into text."',
        TRANSCRIPTION, "the language hint never reaches the ASR prompt",
    ),
    Mutation(
        "transcription_prompt_limit_names_messages", "omnimtp/server/routes/transcriptions.py",
        '            exc.param = "prompt" if is_prompt else "file"',
        "            exc.param = exc.param",
        ("tests/test_server_transcriptions.py::test_an_upload_over_the_prompt_limit_names_file",),
        "an upload whose prompt is over the limit is a 400 naming messages, a field the route does not have",
    ),
    Mutation(
        "transcription_ignores_the_token_limit", "omnimtp/server/routes/transcriptions.py",
        "max_new_tokens=min(engine.config.max_new_tokens, context.max_tokens_limit),",
        "max_new_tokens=engine.config.max_new_tokens,",
        ("tests/test_server_transcriptions.py::test_the_server_token_limit_caps_transcripts_and_realtime_input_"
         "transcripts",),
        "transcripts (the route's and realtime input transcripts) run past --max-tokens-limit",
    ),
    Mutation(
        "transcription_total_tokens_is_the_output", "omnimtp/server/routes/transcriptions.py",
        '            "total_tokens": event.prompt_tokens + event.completion_tokens}',
        '            "total_tokens": event.completion_tokens}',
        ("tests/test_server_transcriptions.py::test_every_format_and_the_stream_give_the_pipelines_text",),
        "a transcription's usage.total_tokens leaves out its input tokens",
    ),
    Mutation(
        "realtime_transcript_total_tokens_is_the_output", "omnimtp/server/routes/realtime/transcription.py",
        '"total_tokens": final.input_tokens + final.output_tokens}}',
        '"total_tokens": final.output_tokens}}',
        ("tests/test_server_transcriptions.py::test_realtime_input_transcripts_equal_the_routes",),
        "a realtime input transcript's usage.total_tokens leaves out its input tokens",
    ),
    Mutation(
        "logprobs_not_the_models_log_softmax", "omnimtp/sampling.py",
        "    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]",
        "    logprobs = torch.log_softmax(logits.float() / 1.5, dim=-1)  # [V]",
        ("tests/test_qwen3_asr.py::test_greedy_logprobs_are_the_references_log_softmax",
         "tests/test_transcription.py::test_greedy_logprobs_are_transformers_log_softmax"),
        "token logprobs are a tempered distribution's, not the log-softmax of the model's logits",
    ),
    Mutation(
        "speculative_logprobs_from_the_first_verify_row", "omnimtp/thinker.py",
        "token_logprob(logits[r, j], token_id, self.logprobs[i])",
        "token_logprob(logits[r, 0], token_id, self.logprobs[i])",
        ("tests/test_thinker_spec.py::test_speculative_logprobs_are_plain_greedys",),
        "every token a speculative step accepts gets the logprob of the step's first verify row",
    ),
    Mutation(
        "transcription_logprobs_in_any_format", "omnimtp/server/routes/transcriptions.py",
        '    if includes and response_format != "json":',
        "    if includes and response_format not in RESPONSE_FORMATS:",
        ("tests/test_server_transcriptions.py::test_bad_input_is_a_4xx_naming_the_field",),
        "include[]=logprobs is taken with response_format text or verbose_json (OpenAI allows it with json only)",
    ),
    Mutation(
        "transcript_logprobs_keep_the_language_tag", "omnimtp/families/text.py",
        "            if num_bytes > end:",
        "            if num_bytes > 0:",
        ("tests/test_realtime_transcription.py::test_a_qwen3_asr_replys_language_tag_is_held_back_from_the_deltas",),
        "a Qwen3-ASR reply's language tag's tokens are listed among the transcript's logprobs",
    ),
    Mutation(
        "transcription_stream_drops_the_last_logprobs", "omnimtp/server/routes/transcriptions.py",
        "                if rest or pending:  # (tokens whose text is none of the transcript's: with an empty delta)",
        "                if rest:  # (tokens whose text is none of the transcript's: with an empty delta)",
        ("tests/test_server_transcriptions.py::test_logprobs_are_the_engines_for_the_transcripts_tokens",),
        "streamed logprobs of the last tokens, whose text is no delta's, go on no delta",
    ),
    Mutation(
        "chat_logprobs_without_alternatives", "omnimtp/server/routes/chat.py",
        '    return {"content": logprob_items(tokenizer, logprobs, with_top=True), "refusal": None}',
        '    return {"content": logprob_items(tokenizer, logprobs), "refusal": None}',
        ("tests/test_server.py::test_chat_logprobs_are_the_engines_streamed_or_not",),
        "a chat completion's logprobs leave out top_logprobs",
    ),
    Mutation(
        "realtime_noise_reduction_refused", "omnimtp/server/routes/realtime/events.py",
        "    noise_reduction: NoiseReduction | None = None",
        "    noise_reduction: None = None",
        ("tests/test_server_realtime.py::test_noise_reduction_is_taken_and_echoed",),
        "a session naming noise_reduction (pipecat's realtime quick-start: near_field) is refused",
    ),
    Mutation(
        "realtime_instructions_alone_get_no_reply", "omnimtp/server/routes/realtime/responses.py",
        "    if not state.items and not instructions:",
        '    if not any(item.role == "user" for item in state.items):',
        ("tests/test_server_realtime.py::test_a_response_to_instructions_alone_speaks_first",),
        "response.create on an empty conversation with instructions (a greeting first) is refused",
    ),
    Mutation(
        "transcription_exact_fit_refused", "omnimtp/pipeline.py",
        '        if len(ids) + max_new_tokens > self.family.max_positions:\n            raise ValueError(f"audio: ',
        '        if len(ids) + max_new_tokens >= self.family.max_positions:\n            raise ValueError(f"audio: ',
        ("tests/test_transcription.py::test_a_prompt_and_reply_cap_that_exactly_fill_the_positions_are_taken",),
        "a transcription whose prompt and max_new_tokens exactly fill the thinker's positions is refused",
    ),
    Mutation(
        "transcribe_cli_seed_is_greedy", "omnimtp/transcribe_cli.py",
        "    sampling = None if args.seed is None else SamplingParams(temperature=1.0)",
        "    sampling = None",
        ("tests/test_transcription.py::test_cli_seed_samples_and_repeats",),
        "omnimtp transcribe --seed N transcribes greedily (the seed does nothing)",
    ),
    Mutation(
        "websocket_key_subprotocol_any_token", "omnimtp/server/guard.py",
        "if prefix == KEY_SUBPROTOCOL and secrets.compare_digest(token.encode(\"utf-8\"), self.api_key):",
        "if prefix == KEY_SUBPROTOCOL:",
        ("tests/test_playground.py",), "a WebSocket upgrade with any key in the subprotocol is let in",
    ),
    Mutation(
        "websocket_subprotocol_not_echoed", "omnimtp/server/websocket.py",
        "        if protocol.partition(\".\")[0] != KEY_SUBPROTOCOL:\n            return protocol",
        "        if protocol.partition(\".\")[0] != KEY_SUBPROTOCOL:\n            return None",
        ("tests/test_playground.py",), "the server answers no subprotocol, so a browser drops the connection",
    ),
    Mutation(
        "first_chunk_waits_for_the_talker_forward", "omnimtp/engine/core.py",
        "        if not self.family.codec_looks_ahead:\n",
        "        if False:\n",
        ("tests/test_pipeline.py",), "a first audio chunk waits for the talker forward toward the next frame",
    ),
    Mutation(
        "hybrid_verify_blocks_keep_chunks", "omnimtp/spec_decode/generate.py",
        "        with verify_blocks(target) if linear_layers else contextlib.nullcontext():",
        "        with contextlib.nullcontext():",
        ("tests/test_spec_hybrid.py",), "a hybrid target's verify blocks run transformers' padded chunked rule",
    ),
    Mutation(
        "hybrid_recurrent_blocks_of_any_length", "omnimtp/spec_decode/hybrid.py",
        "    return num_tokens <= RECURRENT_MAX_TOKENS and",
        "    return num_tokens >= 0 and",
        ("tests/test_spec_hybrid.py",), "long verify blocks run the recurrent rule token by token",
    ),
    Mutation(
        "int4_tiles_add_their_sets_out_of_order", "omnimtp/runtime/kernels/small_batch_linear.c",
        "    INT4_TILE_SET(R, 1, TILE_ROW_NEXT_SET)                                                            \\\n"
        "    INT4_TILE_SET(R, 2, TILE_ROW_NEXT_SET)                                                            \\\n",
        "    INT4_TILE_SET(R, 2, TILE_ROW_NEXT_SET)                                                            \\\n"
        "    INT4_TILE_SET(R, 1, TILE_ROW_NEXT_SET)                                                            \\\n",
        ("tests/test_quantized_linear.py",), "int4 tiles of several rows add their sets in another order than alone",
    ),
    Mutation(
        "int8_tiles_skip_an_odd_last_input", "omnimtp/runtime/kernels/small_batch_linear.c",
        "  for (int64_t k = (p); k < K; k += QSETS) {",
        "  for (int64_t k = (p); k + 1 < K; k += QSETS) {",
        ("tests/test_quantized_linear.py",), "int8 tiles of several rows drop an odd K's last input",
    ),
    Mutation(
        "auto_drafts_while_a_first_audio_waits", "omnimtp/thinker.py",
        "            elif not (plain and self.speculation.is_adaptive):",
        "            else:",
        ADAPTIVE, "auto speculation drafts its long verify steps while a request waits for its first audio",
    ),
    Mutation(
        "engine_never_asks_for_plain_thinker_steps", "omnimtp/engine/core.py",
        "yield from self._think(cohort, plain=is_first_audio_due)",
        "yield from self._think(cohort, plain=False)",
        THINKER_SPEC, "the engine never asks its cohorts for plain steps while a request waits for its first audio",
    ),
    Mutation(
        "engine_asks_for_first_audio_once_a_step", "omnimtp/engine/core.py",
        "        for cohort in thinking:  # asked before each cohort: a request that came during the step counts\n"
        "            is_first_audio_due = self._is_first_audio_due()\n",
        "        is_first_audio_due = self._is_first_audio_due()\n"
        "        for cohort in thinking:  # asked before each cohort: a request that came during the step counts\n",
        THINKER_SPEC, "a request that comes during a step leaves that step's later cohorts drafting",
    ),
    Mutation(
        "tiny_tts_codec_dtype_ignored", "omnimtp/families/qwen3_tts.py",
        "tiny_speech_tokenizer(seed).to_conv_dtype(conv_dtype)",
        "tiny_speech_tokenizer(seed).to_conv_dtype(torch.float32)",
        QWEN3_TTS, "codec_dtype='bfloat16' leaves the decoder in fp32",
    ),
    Mutation(
        "bf16_codec_takes_the_transformer_too", "omnimtp/codec/streaming.py",
        "    for part in (code2wav.upsample, code2wav.decoder):\n        part.to(dtype)",
        "    for part in (code2wav.upsample, code2wav.decoder, code2wav.pre_transformer):\n        part.to(dtype)",
        SPEECH_TOKENIZER, "a bf16 codec runs its transformer in bf16 too",
    ),
    Mutation(
        "bf16_code2wav_casts_the_callers_stack", "omnimtp/codec/streaming.py",
        "        made._modules[name] = copy.deepcopy(code2wav._modules[name])",
        "        made._modules[name] = code2wav._modules[name]",
        ("tests/test_codec_streaming.py",), "a bf16 code2wav casts the stack of the model it was given, not a copy",
    ),
    Mutation(
        "qwen3_omni_ignores_codec_dtype", "omnimtp/families/qwen3_omni.py",
        "        self.codec = StreamingCode2Wav(model.code2wav, conv_dtype=conv_dtype)",
        "        self.codec = StreamingCode2Wav(model.code2wav)",
        ("tests/test_pipeline.py",), "Qwen3-Omni's codec_dtype=\"bfloat16\" leaves code2wav in fp32",
    ),
    Mutation(
        "w4a8_vnni_keeps_the_stored_plus_8", "omnimtp/runtime/kernels/small_batch_linear.c",
        "const __m512i bias = _mm512_set1_epi32(8 * a->xsum[row * a->groups + g]);",
        "const __m512i bias = _mm512_set1_epi32(0 * a->xsum[row * a->groups + g]);",
        QUANTIZED, "the VNNI w4a8 kernel multiplies by the stored q + 8 instead of q",
    ),
    Mutation(
        "w4a8_vnni_drops_a_chain", "omnimtp/runtime/kernels/small_batch_linear.c",
        "                                     _mm512_add_epi32(dot[2][m], dot[3][m]));",
        "                                     _mm512_add_epi32(dot[2][m], dot[2][m]));",
        QUANTIZED, "the VNNI w4a8 kernel leaves the odd inputs of every other word out of its sums",
    ),
    Mutation(
        "w4a8_vnni_drops_an_odd_last_word", "omnimtp/runtime/kernels/small_batch_linear.c",
        "      if (i < i1) W4A8_VNNI_WORD(R, i, 0)",
        "      if (0) W4A8_VNNI_WORD(R, i, 0)",
        QUANTIZED, "the VNNI w4a8 kernel leaves out a group's last word where the group has an odd number of them",
    ),
    Mutation(
        "w4a8_truncates_the_inputs_past_the_last_8", "omnimtp/runtime/kernels/small_batch_linear.c",
        "    float r = __builtin_nearbyintf(x[k] * inv);",
        "    float r = __builtin_truncf(x[k] * inv);",
        QUANTIZED, "w4a8 rounds a group's last inputs (past its whole words of 8) toward zero, not to nearest",
    ),
    Mutation(
        "w4a8_runs_as_weight_only_int4", "omnimtp/runtime/ops.py",
        "int8_activations=mode == \"w4a8\")",
        "int8_activations=False)",
        QUANTIZED, "quantize=\"w4a8\" runs the weight-only int4 kernel: int4's speed, called w4a8",
    ),
    Mutation(
        "quantized_experts_leave_the_rows_grouped", "omnimtp/runtime/moe.py",
        "    return out if order is None else torch.empty_like(out).index_copy_(0, order, out)",
        "    return out",
        QUANTIZED_EXPERTS, "the quantized experts' rows come back in expert order, not (token, rank) order: every "
        "token of a batch mixes other tokens' expert outputs",
    ),
    Mutation(
        "quantized_experts_read_the_first_experts_scales", "omnimtp/runtime/kernels/small_batch_linear.c",
        "scales + experts[i] * scale_stride, y + m0 * N, offsets[i + 1] - m0",
        "scales + experts[0] * scale_stride, y + m0 * N, offsets[i + 1] - m0",
        QUANTIZED_EXPERTS, "the grouped int8 / int4 kernel scales every expert's rows by the first group's expert's "
        "scales",
    ),
    Mutation(
        "quantized_router_runs_on_torch_kernels", "omnimtp/runtime/decoder.py",
        "    if layer.router_row_kernel is None:\n        projected = linear(x, layer.router_in)",
        "    if True:\n        projected = linear(x, layer.router_in)",
        QUANTIZED_EXPERTS, "a quantized Qwen3-MoE layer's router runs on torch's matrix-vector or GEMM kernel by "
        "row count: a row's routing logits, and so its output, depend on the batch",
    ),
    Mutation(
        "quantized_thinker_keeps_its_float_lm_head", "omnimtp/thinker.py",
        "        if self.decoder.quantized_lm_head is not None:  # a quantized thinker's int8 head",
        "        if False:  # a quantized thinker's int8 head",
        QUANTIZED_EXPERTS, "a quantized thinker computes its logits from the float LM head: 0.62 GB a step at "
        "Qwen3-Omni-30B-A3B's vocabulary in bf16 instead of 0.31",
    ),
    Mutation(
        "quantized_checkpoint_loads_in_any_mode", "omnimtp/quantized_checkpoint.py",
        "    if quantize is not None and quantize != mode:",
        "    if False:",
        QUANTIZED_CHECKPOINT, "a quantized checkpoint asked for another mode loads its own silently: --quantize w4a8 "
        "runs int4 weights",
    ),
    Mutation(
        "quantized_checkpoint_reads_expert_0_for_every_expert", "omnimtp/quantized_checkpoint.py",
        "        parts = [self._get(next(s for s in sources if s.pattern == pattern and _expert_index(s) == index))",
        "        parts = [self._get(next(s for s in sources if s.pattern == pattern and _expert_index(s) == 0))",
        QUANTIZED_CHECKPOINT, "the converter quantizes expert 0's weights into every expert of a layer",
    ),
    Mutation(
        "quantized_checkpoint_leaves_buffers_empty", "omnimtp/quantized_checkpoint.py",
        "    model.initialize_weights()\n",
        "\n",
        QUANTIZED_CHECKPOINT, "a quantized checkpoint's non-persistent buffers (rotary tables) are left as "
        "uninitialised memory",
    ),
    Mutation(
        "quantized_checkpoint_ignores_its_generation_config", "omnimtp/quantized_checkpoint.py",
        '    if hasattr(model, "generation_config") and os.path.isfile(os.path.join(path, "generation_config.json")):',
        "    if False:",
        QUANTIZED_CHECKPOINT, "a quantized checkpoint loads without its generation_config.json: a Qwen2.5-Omni without "
        "a tokenizer has no thinker EOS and is refused",
    ),
    Mutation(
        "random_qwen2_5_token2wav_in_bf16", "omnimtp/quantized_checkpoint.py",
        '        float32_prefixes = ("token2wav.",)\n',
        "        float32_prefixes = ()\n",
        QUANTIZED_CHECKPOINT, "a random Qwen2.5-Omni's token2wav is stored in bf16, a dtype it cannot compute in",
    ),
    Mutation(
        "random_qwen2_5_talker_emits_codec_specials", "omnimtp/quantized_checkpoint.py",
        '        zero_rows_from = {"talker.codec_head.weight": model.config.token2wav_config.dit_config.num_embeds'
        " + 1}",
        "        zero_rows_from = {}",
        QUANTIZED_CHECKPOINT, "a random Qwen2.5-Omni's talker now and then emits an id past token2wav's codes, which "
        "token2wav refuses: a real-size benchmark run dies mid-reply",
    ),
    Mutation(
        "tts_checkpoint_requantizes_the_predictor", "omnimtp/families/qwen3_tts.py",
        "                                                 stored=stored.get(self.decoder_paths[1]))",
        "                                                 stored=None)",
        QUANTIZED_CHECKPOINT, "a quantized Qwen3-TTS checkpoint's code predictor is quantized again from the "
        "placeholders its stored matrices replace (all zeros)",
    ),
    Mutation(
        "asr_session_becomes_a_conversation", "omnimtp/server/routes/realtime/settings.py",
        '    if new.type == "realtime" and not context.engine.has_chat:',
        "    if False:",
        ("tests/test_realtime_transcription.py",), "a session of a model that only hears (Qwen3-ASR) is switched to a "
        "conversation it cannot answer",
    ),
    Mutation(
        "asr_session_deltas_keep_the_language_tag", "omnimtp/server/routes/realtime/transcription.py",
        "            if event.text and (delta := deltas.push(event.text)):",
        "            if event.text and (delta := event.text):",
        ("tests/test_realtime_transcription.py",), "a Qwen3-ASR transcription session's deltas carry the reply's "
        "'language X<asr_text>' tag",
    ),
    Mutation(
        "asr_beside_the_model_never_hears", "omnimtp/server/routes/common.py",
        "        if self.asr is not None and (model is None or model in self.asr.model_names):",
        "        if False:",
        ("tests/test_server_asr.py",), "serve --asr-model loads a recognizer that nothing uses: the omni thinker "
        "still transcribes every realtime turn and every request",
    ),
    Mutation(
        "live_recognition_unused_at_commit", "omnimtp/server/routes/realtime/transcription.py",
        "        pieces = live.finish() if live is not None else recognizer(",
        "        pieces = recognizer(",
        ("tests/test_realtime_transcription.py",), "a transcription session's turn heard live by Qwen3-ASR is "
        "transcribed again, whole, once committed (the live transcriptions wasted, the transcript not the stream's)",
    ),
    Mutation(
        "vad_turn_cut_before_what_was_heard_live", "omnimtp/server/routes/realtime/turns.py",
        "            end = max(end, state.live.next_sample)",
        "            end = end",
        ("tests/test_realtime_transcription.py",), "a server-VAD turn is committed shorter than the audio its live "
        "recognition heard: the transcript is of other audio than the item's",
    ),
    Mutation(
        "decode_attention_keeps_the_maximum_in", "omnimtp/runtime/kernels/small_batch_linear.c",
        "      sg[i] = exp_nonpositive(sg[i] - top);",
        "      sg[i] = exp_nonpositive(sg[i]);",
        ("tests/test_small_batch_linear.py",), "the attention kernel's softmax overflows on large scores",
    ),
    Mutation(
        "vector_softmax_keeps_the_maximum_in", "omnimtp/runtime/kernels/small_batch_linear.c",
        "exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + i), vtop))",
        "exp_nonpositive16(_mm512_maskz_loadu_ps(m, sg + i))",
        ("tests/test_small_batch_linear.py",), "the fp32 attention's vector softmax overflows on large scores",
    ),
    Mutation(
        "attention_scores_the_fourth_key_as_the_third", "omnimtp/runtime/kernels/small_batch_linear.c",
        "_mm512_setr_epi32(0, 4, 8, 12, 0, 0,", "_mm512_setr_epi32(0, 4, 8, 8, 0, 0,",
        ("tests/test_small_batch_linear.py",), "the attention's AVX-512 code gives every fourth key the score "
        "of the one before",
    ),
    Mutation(
        "attention_weighs_the_key_before", "omnimtp/runtime/kernels/small_batch_linear.c",
        "const char* row = (const char*)vh + (positions ? positions[i] : i) * v_row_stride * size;",
        "const char* row = (const char*)vh + (positions ? positions[i] : i ? i - 1 : 0) * v_row_stride * size;",
        ("tests/test_small_batch_linear.py",), "the attention's AVX-512 code weighs each key's probability on "
        "the value before",
    ),
    Mutation(
        "bf16_attention_rows_widened_wrong", "omnimtp/runtime/kernels/small_batch_linear.c",
        "_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)", "_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 15)",
        ("tests/test_small_batch_linear.py",), "the attention's AVX-512 code widens a bf16 key or value row wrongly",
    ),
    Mutation(
        "bf16_kv_cache_stays_fp32", "omnimtp/runtime/kv_cache.py",
        'dtype=getattr(decoder, "kv_dtype", None) or decoder.dtype,', "dtype=decoder.dtype,",
        ("tests/test_w4a8_step.py",), "a decoder with kv_dtype bf16 still gets an fp32 KV cache",
    ),
    Mutation(
        "bf16_kv_native_step_skips_the_write", "omnimtp/runtime/kernels/small_batch_linear.c",
        "for (int64_t d = 0; d < D; ++d) ((uint16_t*)cache)[d] = float_to_bf16(v[d]);",
        "for (int64_t d = 0; d < 0; ++d) ((uint16_t*)cache)[d] = float_to_bf16(v[d]);",
        ("tests/test_w4a8_step.py",), "the native step leaves a bf16 cache's new key and value unwritten",
    ),
    Mutation(
        "asr_kv_dtype_ignored", "omnimtp/families/qwen3_asr.py",
        ".with_kv_dtype(kv_dtype and getattr(torch, kv_dtype))", ".with_kv_dtype(None)",
        ("tests/test_qwen3_asr.py::test_a_bf16_kv_cache_transcribes_alone_as_in_a_batch_near_the_fp32_cache",),
        "Qwen3-ASR's kv_dtype=\"bfloat16\" leaves the cache in fp32",
    ),
    Mutation(
        "w4a8_step_silu_of_a_negative_gate", "omnimtp/runtime/kernels/small_batch_linear.c",
        "_mm512_mask_mul_ps(inv, negative, e, inv);", "inv;",
        ("tests/test_w4a8_step.py",), "the native step's vector SiLU takes sigmoid(|gate|) for a negative gate",
    ),
    Mutation(
        "w4a8_step_quantizes_every_row_as_the_first", "omnimtp/runtime/kernels/small_batch_linear.c",
        "const int64_t r = t / groups_i, g = t % groups_i, i0 = g * group_i;",
        "const int64_t r = 0, g = t % groups_i, i0 = g * group_i;",
        ("tests/test_w4a8_step.py",), "the native step's down projection reads row 0's activations for every row",
    ),
    Mutation(
        "decode_attention_drops_the_last_value", "omnimtp/runtime/kernels/small_batch_linear.c",
        "  for (int64_t i = 0; i < n; ++i) {\n    const float* row = row_as_float(vh,",
        "  for (int64_t i = 0; i < n - 1; ++i) {\n    const float* row = row_as_float(vh,",
        ("tests/test_small_batch_linear.py",), "the attention kernel's weighted sum leaves out the newest position",
    ),
    Mutation(
        "bf16_attention_keeps_its_old_output", "omnimtp/runtime/kernels/bf16_attention.c",
        "_mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), factor));",
        "(void)acc;",
        BF16_ATTENTION, "the many-row bf16 attention does not rescale a query's output when its maximum grows",
    ),
    Mutation(
        "bf16_attention_sees_past_its_count", "omnimtp/runtime/kernels/bf16_attention.c",
        "seen[j] = (__mmask16)(visible >= 16 * (j + 1) ? 0xFFFF",
        "seen[j] = (__mmask16)(visible >= 16 * j + 1 ? 0xFFFF",
        BF16_ATTENTION, "a query of the many-row bf16 attention sees the keys after its count up to the next 16",
    ),
    Mutation(
        "bf16_attention_reads_a_rows_padding", "omnimtp/runtime/kernels/bf16_attention.c",
        "      block_values = tail;",
        "      (void)tail;",
        BF16_ATTENTION, "the many-row bf16 attention weights a shorter row's padding values by zero (NaN there "
        "poisons the row)",
    ),
    Mutation(
        "w8a8_epilogue_drops_the_residual", "omnimtp/runtime/kernels/w8a8_epilogues.c",
        "if (residual) x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, residual + k), x);",
        "(void)residual;",
        W8A8_EPILOGUES, "the fused pass after a w8a8 layer's o / down GEMM leaves out the residual add",
    ),
    Mutation(
        "w8a8_epilogue_rope_sign_flipped", "omnimtp/runtime/kernels/w8a8_epilogues.c",
        "head[d] = v[d] * c[d] + v[d + half] * s[d];",
        "head[d] = v[d] * c[d] - v[d + half] * s[d];",
        W8A8_EPILOGUES, "the fused q/k pass rotates the first half of each head the wrong way",
    ),
    Mutation(
        "w8a8_epilogue_silu_of_the_negated_gate", "omnimtp/runtime/kernels/w8a8_epilogues.c",
        "exp16(_mm512_xor_ps(g, sign))", "exp16(g)",
        W8A8_EPILOGUES, "the fused gated pass takes g * sigmoid(-g) for silu(g)",
    ),
    Mutation(
        "w8a8_layer_reads_its_own_norm_for_the_next", "omnimtp/runtime/decoder.py",
        "else decoder.layers[i + 1].input_norm", "else layer.input_norm",
        W8A8_EPILOGUES, "a fused w8a8 layer quantizes the next layer's rows with its own input norm's weight",
    ),
    Mutation(
        "w8a8_prefill_attention_stays_on_sdpa", "omnimtp/runtime/decoder.py",
        "bf16_many_rows=decoder.quantize in MANY_ROW_MODES,",
        "bf16_many_rows=False,",
        BF16_ATTENTION, "int8_compute's prompt forwards (Qwen3-ASR's prefill, the aligner's forward) run their "
        "attention on fp32 SDPA, not the bf16 kernel",
    ),
    Mutation(
        "bf16_decode_attention_stays_on_sdpa", "omnimtp/runtime/ops.py",
        "query.dtype in small_batch_linear.DECODE_ATTENTION_DTYPES",
        "query.dtype == torch.float32",
        ("tests/test_small_batch_linear.py::test_one_position_a_rows_attention_runs_on_the_kernel_only_where_it_applies",),
        "a bf16 decoder's decode step (the Qwen3-Omni thinker's) runs its attention on SDPA, not the kernel",
    ),
    Mutation(
        "bf16_decode_attention_truncates", "omnimtp/runtime/kernels/small_batch_linear.c",
        "  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);",
        "  return (uint16_t)(bits >> 16);",
        ("tests/test_small_batch_linear.py",), "the bf16 attention's outputs are truncated, not rounded to nearest",
    ),
    Mutation(
        "bf16_decode_attention_ties_away", "omnimtp/runtime/kernels/small_batch_linear.c",
        "  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);",
        "  return (uint16_t)((bits + 0x8000u) >> 16);",
        ("tests/test_small_batch_linear.py::test_bf16_decode_attention_of_rows_with_a_mask_is_each_row_alone_and_rounds_nan_and_ties",),
        "the bf16 attention rounds its ties away from zero, not to even (torch's rounding)",
    ),
    Mutation(
        "decode_attention_dtypes_unchecked", "omnimtp/runtime/kernels/small_batch_linear.py",
        "    if not (query.dtype == keys.dtype == values.dtype and query.dtype in DECODE_ATTENTION_DTYPES):",
        "    if False:",
        ("tests/test_small_batch_linear.py::test_decode_attention_is_the_same_on_any_thread_count_and_survives_large_scores",),
        "decode_attention reads a bf16 query against fp32 keys (or fp16 ones) as raw bytes: garbage, no error",
    ),
    Mutation(
        "one_row_attention_stays_on_sdpa", "omnimtp/runtime/ops.py",
        "        on_kernel, rows_mask = _decode_attention_mask(query[None], keys, values, mask)\n        if on_kernel:",
        "        on_kernel, rows_mask = _decode_attention_mask(query[None], keys, values, mask)\n        if False:",
        ("tests/test_small_batch_linear.py",), "a batch-1 decode step's attention never runs on the kernel",
    ),
    Mutation(
        "batched_decode_attention_stays_on_sdpa", "omnimtp/runtime/ops.py",
        "    if num_new == 1 and not fp32_manual:",
        "    if False:",
        ("tests/test_small_batch_linear.py",), "a batched decode step's attention never runs on the kernel",
    ),
    Mutation(
        "decode_attention_weights_masked_keys_by_zero", "omnimtp/runtime/kernels/small_batch_linear.c",
        "    if (mask[s]) positions[count++] = s;",
        "    positions[count++] = s;",
        ("tests/test_small_batch_linear.py",), "the attention kernel reads masked keys as visible",
    ),
    Mutation(
        "decode_attention_group_unchecked", "omnimtp/runtime/ops.py",
        "        and num_heads // keys.shape[1] <= small_batch_linear.DECODE_ATTENTION_MAX_GROUP\n",
        "",
        ("tests/test_small_batch_linear.py::test_decode_attention_runs_on_the_kernel_only_within_its_range",),
        "attention with more than 16 query heads a KV head goes to the kernel, which refuses it (ValueError)",
    ),
    Mutation(
        "decode_attention_head_dim_unchecked", "omnimtp/runtime/ops.py",
        "        and head_dim <= small_batch_linear.DECODE_ATTENTION_MAX_HEAD_DIM\n",
        "",
        ("tests/test_small_batch_linear.py::test_decode_attention_runs_on_the_kernel_only_within_its_range",),
        "attention with a head_dim over 256 goes to the kernel, which refuses it (ValueError)",
    ),
    Mutation(
        "decode_attention_shared_mask_on_sdpa", "omnimtp/runtime/ops.py",
        "and mask.shape[0] in (1, num_rows)",
        "and mask.shape[0] == num_rows",
        ("tests/test_small_batch_linear.py::test_one_mask_shared_by_several_rows_runs_on_the_kernel",),
        "a batched decode step whose rows share one mask runs on SDPA, not the kernel",
    ),
    Mutation(
        "int4_groups_of_64", "omnimtp/runtime/ops.py",
        "INT4_GROUP_SIZE = 128  # inputs per int4 scale",
        "INT4_GROUP_SIZE = 64  # inputs per int4 scale",
        ("tests/test_quantized_linear.py::test_int4_scales_are_per_output_and_group_of_128_inputs",),
        "int4 and w4a8 weights get a scale per 64 inputs: twice the scales, other values than documented",
    ),
    Mutation(
        "w4a8_isa_argument_dropped", "omnimtp/runtime/kernels/small_batch_linear.py",
        "        choice = -1 if isa is None else int(isa == W4A8_ISAS[0])",
        "        choice = -1",
        ("tests/test_quantized_linear.py::test_the_isa_argument_reaches_the_kernel",),
        "w4a8_linear(isa=...) runs this CPU's best instructions whatever it names (the same bits: unseen)",
    ),
    # --- the front door: start-up, first output, quiet logs -------------------------------------------
    Mutation(
        "tiny_model_built_on_every_core", "omnimtp/runtime/device.py",
        "    previous = torch.get_num_threads()\n    torch.set_num_threads(1)\n",
        "    previous = torch.get_num_threads()\n    torch.set_num_threads(previous)\n",
        ("tests/test_tiny_models.py::test_a_tiny_model_is_built_on_one_thread",),
        "a tiny model is built on every core (seconds on a busy box instead of a fraction of one)",
    ),
    Mutation(
        "ray_workers_not_quieted", "omnimtp/server/ray_serve.py",
        '    runtime_env = {} if verbose else {"worker_process_setup_hook": f"{__name__}.quiet_ray_worker"}',
        "    runtime_env = {}",
        ("tests/test_ray_units.py::test_ray_workers_drop_the_routers_expected_deadline_warning_unless_verbose",),
        "serve --replicas prints Serve's router warning each time a busy replica answers its probe after 0.1 s",
    ),
    Mutation(
        "ray_worker_filter_too_broad", "omnimtp/server/ray_serve.py",
        '    "ray.serve": "Failed to get queue length from ",',
        '    "ray.serve": "Failed to ",',
        ("tests/test_ray_units.py::test_ray_workers_drop_the_routers_expected_deadline_warning_unless_verbose",),
        "the proxy also drops Serve's warnings that a replica is unavailable or dead",
    ),
    Mutation(
        "small_model_on_every_core", "omnimtp/runtime/device.py",
        "    elif num_parameters < SMALL_MODEL_PARAMETERS:\n        torch.set_num_threads(1)",
        "    elif num_parameters < 0:\n        torch.set_num_threads(1)",
        ("tests/test_tiny_models.py::test_one_thread_rule_for_a_small_model_unless_told",),
        "a tiny model runs on every core by default (10-25x slower than one thread on a busy box)",
    ),
    Mutation(
        "every_family_imported", "omnimtp/families/__init__.py",
        "    module, name = FAMILIES[model_type]\n    return getattr(importlib.import_module(module), name)",
        "    classes = {key: getattr(importlib.import_module(m), n) for key, (m, n) in FAMILIES.items()}\n"
        "    return classes[model_type]",
        ("tests/test_cli.py::test_each_command_imports_only_what_it_runs",),
        "a command on one model imports every family's code (Qwen2.5-Omni, Qwen3-ASR, Qwen3-TTS): slower start",
    ),
    Mutation(
        "speaker_encoder_for_every_tts_model", "omnimtp/models/qwen3_tts.py",
        "from torch import nn\n",
        "from torch import nn\n\nimport omnimtp.models.speaker_encoder  # noqa: F401\n",
        ("tests/test_cli.py::test_each_command_imports_only_what_it_runs",),
        "every Qwen3-TTS model imports the Base model's speaker encoder (Qwen2.5-Omni's modeling) at start-up",
    ),
    Mutation(
        "too_many_threads_silent", "omnimtp/runtime/device.py",
        "        if warning is not None:\n            logger.warning(warning)",
        "        if False:\n            logger.warning(warning)",
        ("tests/test_tiny_models.py::test_threads_beyond_what_the_model_can_use_warn",),
        "--threads beyond what the model can use says nothing",
    ),
    Mutation(
        "tiny_model_random_weights_unsaid", "omnimtp/speak_cli.py",
        "    note = None if args.demo else random_weights_note(args.model)",
        "    note = None",
        ("tests/test_speak_cli.py::test_a_built_in_tiny_model_says_once_that_its_weights_are_random",),
        "a tiny model's random bytes and finish=length come with no word that random weights give them",
    ),
    Mutation(
        "qwen2_5_talker_id_warnings_shown", "omnimtp/console.py",
        "                    and len(words) > 2 and words[2] in _QWEN2_5_TALKER_TEXT_IDS)",
        "                    and len(words) > 2 and words[2] in ())",
        ("tests/test_cli.py::test_only_the_qwen2_5_talkers_text_ids_are_quiet_of_the_vocabulary_warnings",),
        "every Qwen2.5-Omni load prints transformers' seven expected vocabulary warnings",
    ),
    Mutation(
        "playground_hidden_fields_shown", "omnimtp/server/playground/style.css",
        "[hidden] { display: none !important; }",
        "[hidden] { }",
        ("tests/test_playground.py::test_the_instructions_field_shows_only_where_the_model_takes_them",),
        "the playground's hidden fields (Instructions) show, as label.wide's display rule overrides hidden",
    ),
    Mutation(
        "base_model_requires_a_voice_over_http", "omnimtp/server/routes/voices.py",
        "        voice = None\n    elif body.voice is not None:",
        "        raise APIError(400, \"voice: required\", param=\"voice\", code=\"missing_required_parameter\")\n"
        "    elif body.voice is not None:",
        ("tests/test_server_voices.py::test_a_base_model_speaks_without_a_voice_as_the_python_api",),
        "a Base model over HTTP refuses a request without a voice, which the CLI and Python API speak",
    ),
    Mutation(
        "ray_logs_info_by_default", "omnimtp/server/ray_serve.py",
        "    return {\"log_level\": \"INFO\" if verbose else \"WARNING\", \"enable_access_log\": verbose}",
        "    return {\"log_level\": \"INFO\", \"enable_access_log\": True}",
        ("tests/test_ray_units.py::test_ray_logs_warnings_only_unless_verbose",),
        "Ray Serve logs every request of every replica without --verbose",
    ),
    # --- runaway audio and the outside fuzz's findings ---------------------------------------------
    Mutation(
        "runaway_text_bound_off", "omnimtp/talker/loop.py",
        "        elif runaway is not None and row.num_frames >= runaway.max_text_frames(row.num_text_rows):",
        "        elif False:",
        ("tests/test_server.py::test_a_talker_that_never_ends_is_cut_at_its_texts_bound_and_counted",),
        "a talker that never ends runs to max_frames whatever its text",
    ),
    Mutation(
        "runaway_text_bound_ignores_pushed_rows", "omnimtp/talker/loop.py",
        "        row.num_text_rows += rows.shape[0]\n",
        "",
        ("tests/test_pipeline_talker_loop.py",), "a text still arriving is cut at the bound of its first rows",
    ),
    Mutation(
        "runaway_repetition_off", "omnimtp/talker/loop.py",
        "        elif row.repeats is not None and row.repeats.push(next_code0):",
        "        elif False:",
        ("tests/test_pipeline_talker_loop.py",), "code 0 repeating one pattern runs on to max_frames",
    ),
    Mutation(
        "runaway_repeat_period_off_by_one", "omnimtp/talker/loop.py",
        "        return any(self.runs[p] + p >= self.num_frames for p in range(1, self.max_period + 1))",
        "        return any(self.runs[p] + p >= self.num_frames for p in range(1, self.max_period))",
        ("tests/test_pipeline_talker_loop.py",), "a pattern of exactly max_repeat_period frames is never caught",
    ),
    Mutation(
        "runaway_cut_not_counted", "omnimtp/server/scheduler.py",
        "                self.metrics.audio_cut.labels(cut_by=request.audio_cut_by).inc()",
        "                pass",
        ("tests/test_server.py::test_a_talker_that_never_ends_is_cut_at_its_texts_bound_and_counted",),
        "audio cut by a runaway limit is not counted in the metrics",
    ),
    Mutation(
        "websocket_receive_never_yields", "omnimtp/server/websocket.py",
        "            await asyncio.sleep(0)\n            try:",
        "            try:",
        ("tests/test_server_websocket.py::test_receive_yields_before_each_message",),
        "a burst of buffered WebSocket events runs without letting any other request in",
    ),
    Mutation(
        "speech_stream_burst_tokenized_per_delta", "omnimtp/server/routes/speech_stream.py",
        "    if len(deltas) > 1:",
        "    if False:",
        ("tests/test_speech_stream.py::test_a_burst_of_tiny_deltas_does_not_hold_up_the_server",),
        "each delta of a burst re-tokenizes the whole text so far (quadratic work per burst)",
    ),
    Mutation(
        "idle_stream_requests_fill_the_queue", "omnimtp/server/scheduler.py",
        "        num_queued = self._core.num_queued()\n",
        "        num_queued = len(self._core.waiting)\n",
        ("tests/test_speech_stream.py::test_sessions_waiting_for_their_first_words_do_not_fill_the_queue",),
        "streamed-text requests waiting for their first words count against --max-queue (idle sessions cause 429s)",
    ),
    Mutation(
        "multipart_parsed_on_the_loop", "omnimtp/server/guard.py",
        "            return await run_in_threadpool(asyncio.run, parser.parse())",
        "            return await parser.parse()",
        ("tests/test_server_transcriptions.py::test_a_large_malformed_upload_is_parsed_off_the_event_loop",),
        "a 16 MiB multipart upload is parsed on the event loop (seconds without /health)",
    ),
    Mutation(
        "conversation_media_parts_per_request", "omnimtp/server/served_model.py",
        "        if request.cache_key is None:\n            return self.media_limits",
        "        if True:\n            return self.media_limits",
        ("tests/test_server_realtime.py::test_a_conversation_answers_after_more_audio_turns_than_max_media_parts",),
        "a realtime session cannot answer once its history holds more than --max-media-parts audio turns",
    ),
    Mutation(
        "non_seekable_audio_refused", "omnimtp/media.py",
        "            while len(block := sound.read(_AUDIO_BLOCK_FRAMES, dtype=\"float32\", always_2d=True)):",
        "            for block in sound.blocks(_AUDIO_BLOCK_FRAMES, dtype=\"float32\", always_2d=True):",
        ("tests/test_media.py",), "GSM 6.10, G.721 and XI audio (not seekable to libsndfile) cannot be read",
    ),
    Mutation(
        "loud_audio_taken", "omnimtp/media.py",
        "    if np.abs(samples).max() > MAX_AUDIO_MAGNITUDE:",
        "    if False:",
        ("tests/test_media.py", "tests/test_server_transcriptions.py::test_bad_input_is_a_4xx_naming_the_field"),
        "audio of ±1e20 samples is heard (a transcript of NUL characters) instead of refused",
    ),
    Mutation(
        "audio_sample_rate_unbounded", "omnimtp/media.py",
        "        if rate > MAX_AUDIO_SAMPLE_RATE:",
        "        if False:",
        ("tests/test_media.py",), "a header declaring 2^31 - 1 samples/s is resampled",
    ),
    Mutation(
        "batch_items_encoded_on_the_loop", "omnimtp/server/routes/speech.py",
        "audio = await run_in_threadpool(_base64_audio, samples, context.engine.sample_rate, item.response_format)",
        "audio = _base64_audio(samples, context.engine.sample_rate, item.response_format)",
        ("tests/test_server.py::test_whole_speech_files_are_encoded_off_the_event_loop",),
        "/v1/audio/speech/batch encodes its items on the event loop (32 mp3 items: /health waits)",
    ),
    Mutation(
        "whole_speech_file_encoded_on_the_loop", "omnimtp/server/routes/speech.py",
        "Response(await run_in_threadpool(encode_audio, samples, sample_rate, fmt)",
        "Response(encode_audio(samples, sample_rate, fmt)",
        ("tests/test_server.py::test_whole_speech_files_are_encoded_off_the_event_loop",),
        "a whole-file /v1/audio/speech response is encoded on the event loop",
    ),
    Mutation(
        "models_omit_transcriptions", "omnimtp/server/served_model.py",
        "                + ([\"/v1/audio/transcriptions\"] if hears_audio else [])",
        "                + ([] if hears_audio else [])",
        ("tests/test_server_transcriptions.py::test_models_lists_transcriptions_for_a_model_that_hears",),
        "/v1/models does not list transcriptions for an omni model that hears",
    ),
    Mutation(
        "g711_append_decoded_before_its_size_check", "omnimtp/server/routes/realtime/turns.py",
        "    if len(state.audio_buffer) + num_bytes > max_bytes:",
        "    if len(state.audio_buffer) + len(pcm_bytes(data, state.settings.input_format, \"audio\")) > max_bytes:",
        ("tests/test_server_realtime.py::test_a_g711_append_over_the_limit_is_refused_before_it_is_decoded",),
        "a G.711 append over the buffer limit is decoded on the event loop before it is refused",
    ),
    Mutation(
        "transcription_refuses_negative_seeds", "omnimtp/server/routes/transcriptions.py",
        "    seed = _number(fields, \"seed\", None, INT64_MIN, INT64_MAX, int)",
        "    seed = _number(fields, \"seed\", None, 0, INT64_MAX, int)",
        ("tests/test_server_transcriptions.py::test_a_negative_seed_is_taken_as_on_every_route",),
        "a negative seed is refused on /v1/audio/transcriptions while every other route takes it",
    ),
    Mutation(
        "format_change_keeps_old_audio", "omnimtp/server/routes/realtime/settings.py",
        "        state.clear_buffer()  # its audio is in the old format: never heard at the new one",
        "        pass",
        ("tests/test_server_realtime.py::test_a_new_input_format_empties_the_buffer_of_the_old_ones_audio",),
        "audio buffered before an input format change is committed as audio of the new format",
    ),
    Mutation(
        "streaming_truncate_leaves_the_reply_running", "omnimtp/server/routes/realtime/conversation.py",
        "    if is_streaming:\n        _stop_reply(state, item)",
        "    if False:\n        _stop_reply(state, item)",
        ("tests/test_realtime_items.py::test_a_reply_still_streaming_is_truncated_to_what_was_heard",),
        "a reply truncated while it streams goes on streaming what the user will not hear",
    ),
    Mutation(
        "item_added_is_the_beta_name", "omnimtp/server/routes/realtime/conversation.py",
        '    await state.session.send({"type": "conversation.item.added", "previous_item_id": previous_item_id,',
        '    await state.session.send({"type": "conversation.item.created", "previous_item_id": previous_item_id,',
        ("tests/test_realtime_items.py::test_items_go_after_previous_item_id_and_are_retrieved_and_deleted",),
        "a new item is announced with the beta conversation.item.created, which GA clients (pipecat) refuse",
    ),
    Mutation(
        "duplicate_item_id_generic_code", "omnimtp/server/routes/realtime/conversation.py",
        '                         code="item_create_duplicate_item_id")',
        '                         code="invalid_value")',
        ("tests/test_realtime_items.py::test_items_go_after_previous_item_id_and_are_retrieved_and_deleted",),
        "a re-created item id gets a code LiveKit's chat-context sync does not know as 'already there'",
    ),
    Mutation(
        "openai_voice_alias_ignored", "omnimtp/server/routes/voices.py",
        "    return context.voice_aliases.get(voice.lower(), voice)",
        "    return voice",
        ("tests/test_server_aliases.py::test_an_openai_voice_speaks_as_the_speaker_it_names",),
        "OpenAI's voice names (pipecat's TTS sends only those) are unknown voices",
    ),
    Mutation(
        "speech_sse_deltas_always_pcm", "omnimtp/server/routes/speech.py",
        "    encoder = StreamEncoder(fmt, sample_rate)\n    chunks = []\n",
        "    encoder = StreamEncoder(\"pcm\", sample_rate)\n    chunks = []\n",
        ("tests/test_server_aliases.py::test_speech_sse_deltas_are_the_asked_format",),
        "SSE speech deltas are PCM whatever response_format asks (LiveKit's mp3 over SSE cannot be decoded)",
    ),
    Mutation(
        "semantic_vad_eagerness_ignored", "omnimtp/server/vad.py",
        "        return cls(silence_duration_ms=EAGERNESS_SILENCE_MS[eagerness], create_response=create_response,",
        "        return cls(create_response=create_response,",
        ("tests/test_realtime_vad.py::test_semantic_vad_eagerness_is_the_silence_that_ends_a_turn",),
        "semantic_vad's eagerness does not change when a turn ends",
    ),
    Mutation(
        "transcription_session_answers", "omnimtp/server/routes/realtime/turns.py",
        "        if config.create_response and state.response is None and state.settings.type == \"realtime\":",
        "        if config.create_response and state.response is None:",
        ("tests/test_realtime_transcription.py::test_an_intent_transcription_session_transcribes_each_turn_and_never_answers",),
        "a transcription session answers each turn it transcribes",
    ),
    Mutation(
        "reply_item_joins_at_its_end", "omnimtp/server/routes/realtime/responses.py",
        "    previous = insert_item(state, item, None)\n",
        "    previous = None\n",
        ("tests/test_realtime_items.py::test_a_reply_still_streaming_is_truncated_to_what_was_heard",),
        "a reply still streaming is not in the conversation: a barge-in's truncate gets item_not_found",
    ),
    Mutation(
        "idle_timeout_ignored", "omnimtp/server/routes/realtime/responses.py",
        "    state.turns.idle_timer = asyncio.get_running_loop().create_task(_idle(state, seconds))",
        "    state.turns.idle_timer = None",
        ("tests/test_realtime_vad.py::test_idle_timeout_answers_the_users_silence_after_the_reply_has_played",),
        "idle_timeout_ms is reported but never fires",
    ),
    Mutation(
        "long_transcription_prompt_blamed_on_the_file", "omnimtp/server/routes/transcriptions.py",
        "            exc.param = \"prompt\" if is_prompt else \"file\"",
        "            exc.param = \"file\"",
        ("tests/test_server_transcriptions.py::test_bad_input_is_a_4xx_naming_the_field",),
        "a transcription prompt over the token limit is reported as the file's fault",
    ),
    Mutation(
        "unknown_keys_left_to_the_schema", "omnimtp/server/routes/common.py",
        "            if unknown is not None:\n                raise APIError(400, f\"Unrecognized request argument",
        "            if False:\n                raise APIError(400, f\"Unrecognized request argument",
        ("tests/test_server_structure.py::test_a_body_of_many_unknown_keys_is_refused_without_stalling_health",),
        "100,000 unknown keys are left to the schema, whose errors hold the event loop for most of a second",
    ),
    Mutation(
        "batch_schema_errors_dotted", "omnimtp/server/routes/speech.py",
        "        if error.param is not None and (item := _ITEM_PATH.match(error.param)):",
        "        if False and (item := _ITEM_PATH.match(error.param)):",
        ("tests/test_audio_formats.py::test_a_batch_items_schema_error_names_the_item_as_its_own_errors_do",),
        "a speech batch's schema errors spell an item's field items.1.speed, its item errors items[2].voice",
    ),
    Mutation(
        "huge_json_integers_converted", "omnimtp/server/guard.py",
        "        value = json.loads(text, parse_int=_parse_int)",
        "        value = json.loads(text)",
        ("tests/test_server_structure.py::test_an_integer_of_more_than_100_digits_is_refused_as_it_is_read",),
        "integers of thousands of digits are converted (quadratic, holding the GIL) before any limit refuses them",
    ),
    # --- admission by real-time capacity ---------------------------------------------------------------
    Mutation(
        "admission_ignores_capacity", "omnimtp/engine/core.py",
        "        if self.max_speaking is None:\n            return waiting\n",
        "        return waiting\n",
        ADMISSION, "every waiting stream starts at once, whatever the capacity (the playing ones then stall)",
    ),
    Mutation(
        "playout_chunks_one_frame_long", "omnimtp/engine/playback.py",
        "int(1 + num_decoded * (1 - playout_rtf) / playout_rtf + 1e-9)",
        "int(2 + num_decoded * (1 - playout_rtf) / playout_rtf + 1e-9)",
        ADMISSION, "streamed chunks one frame longer than a listener who plays from the first chunk can wait for",
    ),
    Mutation(
        "admission_by_the_mean_step", "omnimtp/server/admission.py",
        "        costs = [c for c in (self.costs.predict(num_streams), self.first_steps.predict(num_streams)) if c",
        "        costs = [c for c in (self.costs.predict(num_streams),) if c",
        ("tests/test_admission.py::"
         "test_a_step_is_costed_as_measured_and_as_one_in_which_every_stream_decodes_a_one_frame_chunk",),
        "admission costs a step by the mean and lets in streams whose first steps run over the frame",
    ),
    Mutation(
        "admission_by_the_first_steps_alone", "omnimtp/server/admission.py",
        "        costs = [c for c in (self.costs.predict(num_streams), self.first_steps.predict(num_streams)) if c",
        "        costs = [c for c in (self.first_steps.predict(num_streams) or self.costs.predict(num_streams),) if c",
        ("tests/test_admission.py::"
         "test_a_step_is_costed_as_measured_and_as_one_in_which_every_stream_decodes_a_one_frame_chunk",),
        "admission costs a step as a stream's first steps only and lets in chats whose later steps cost more",
    ),
    Mutation(
        "sizes_measured_at_start_taken_as_served", "omnimtp/server/admission.py",
        "        for table in (self.costs, self.first_steps, self.decode_costs):\n"
        "            table.seed(table.measured())",
        "        for table in (self.costs, self.first_steps, self.decode_costs):\n            pass",
        ("tests/test_admission.py::test_sizes_measured_at_start_give_the_shape_and_serving_the_scale",),
        "the costs measured at start without clients are taken as served costs, and a chat server admits too many",
    ),
    Mutation(
        "chat_sizes_measured_by_warm_up_replies", "omnimtp/server/scheduler.py",
        "        if (self.admission is not None and not self.has_chat and not self._warm_stop.is_set()",
        "        if (self.admission is not None and not self._warm_stop.is_set()",
        ("tests/test_admission.py::test_a_chat_server_measures_its_sizes_while_serving_only",),
        "a chat server takes its sizes from warm-up replies that show none of a chat's costs, and admits too many",
    ),
    Mutation(
        "eager_ops_follow_another_threads_compile", "omnimtp/runtime/tracing.py",
        "    return torch.compiler.is_compiling() and _traced_in_this_thread()",
        "    return torch.compiler.is_compiling()",
        ("tests/test_codec_transformer.py::test_a_decode_while_another_thread_compiles_runs_on_the_packs_with_the_same_bits",),
        "a request decoded while the warm-up compiles in another thread takes the traced code's paths (other bits)",
    ),
    Mutation(
        "capacity_not_measured_at_start", "omnimtp/server/scheduler.py",
        "        for n in range(1, self.config.max_batch_size + 1):\n            for is_measured in (False, True):",
        "        for n in range(1, 2):\n            for is_measured in (False, True):",
        ("tests/test_admission.py::test_the_warm_up_reply_measures_each_size_that_fits_before_a_user_asks",),
        "a server measures no size above one at start and grows its capacity from a guess that errs high",
    ),
    Mutation(
        "restart_forgets_step_costs", "omnimtp/server/scheduler.py",
        "        if self.admission is not None:\n            self._seed_step_costs()\n",
        "        if self.admission is not None:\n            pass\n",
        ADMISSION, "a restarted server ignores the step costs it kept and admits one stream at a time again",
    ),
    Mutation(
        "kept_step_costs_of_another_setting", "omnimtp/server/scheduler.py",
        '("max_batch_size", "first_chunk_frames", "chunk_frames",',
        '("max_batch_size", "first_chunk_frames",',
        ADMISSION, "step costs kept under other chunk settings are read back as if they were this engine's",
    ),
    Mutation(
        "realtime_wait_unannounced", "omnimtp/server/scheduler.py",
        "            remaining = max(0, core.num_startable(has_speech) - len(core.waiting))\n",
        "            remaining, position = core.num_startable(has_speech), 0\n",
        ADMISSION, "a realtime response that waits for capacity is told it starts at once",
    ),
    Mutation(
        "engine_thread_on_the_starters_threads", "omnimtp/server/scheduler.py",
        "    def _run(self) -> None:\n        torch.set_num_threads(self.num_threads)\n",
        "    def _run(self) -> None:\n",
        ADMISSION, "the engine thread runs on the thread count of whoever started it (one, in serve), not the model's",
    ),
    Mutation(
        "serve_loads_on_its_own_thread", "omnimtp/runtime/device.py",
        "    thread.start()\n    thread.join()\n",
        "    thread.run()\n",
        ADMISSION, "serve builds its model on the thread that then serves HTTP (its OpenMP pool outlives the load)",
    ),
    Mutation(
        "capacity_estimate_too_kind", "omnimtp/server/admission.py",
        "        return measured[n] * num_streams / n",
        "        return measured[n]",
        ADMISSION, "an unmeasured batch size is assumed to cost what a smaller one measured (capacity overestimated)",
    ),
    Mutation(
        "capacity_without_the_trend", "omnimtp/server/admission.py",
        "            if per_stream > 0:\n",
        "            if per_stream < 0:\n",
        ADMISSION, "one stream past the largest measured is estimated in proportion: a stream whose step fits thanks "
        "to the fixed part is never tried, never measured, and the server plays fewer streams than it can",
    ),
    Mutation(
        "kept_step_costs_unscaled", "omnimtp/server/admission.py",
        "            scale = means[max(both)] / self._seeded[max(both)] if both else 1.0\n",
        "            scale = 1.0\n",
        ADMISSION, "costs kept from a slow spell hold a restarted server's capacity down for good (the sizes it "
        "will not run are never measured again)",
    ),
    Mutation(
        "step_costs_by_median", "omnimtp/server/admission.py",
        "        means = {n: statistics.fmean(samples)",
        "        means = {n: statistics.median(samples)",
        ADMISSION, "a step's cost is its typical step's, without the chunk decoding that falls in a few steps",
    ),
    Mutation(
        "deferred_chunks_ignore_the_lead", "omnimtp/engine/core.py",
        "        if lead is None or lead < 2 * self.step_s + decode_s + decode_s / growth:\n            return False\n",
        "        if lead is None:\n            return False\n",
        ADMISSION, "a chunk waits for others even when its own listener is about to run dry",
    ),
    Mutation(
        "later_chunks_never_wait", "omnimtp/engine/core.py",
        "        if later and config.max_defer_steps > 0:",
        "        if False:",
        ADMISSION, "a long chunk is decoded once due while a newcomer's player holds less than its decoding",
    ),
    Mutation(
        "chunks_deferred_without_bound", "omnimtp/engine/core.py",
        "                if waited_now or (request.num_deferred < config.max_defer_steps\n",
        "                if waited_now or (True\n",
        ADMISSION, "later chunks wait for newcomers as long as newcomers keep coming (max_defer_steps ignored)",
    ),
    Mutation(
        "later_chunks_after_the_talker_forward", "omnimtp/engine/core.py",
        "            yield from self._decode_due()\n            decode_s = self.clock() - started\n",
        "            yield from self._decode_blocks(self._due_chunks()[0], is_first=True)\n"
        "            decode_s = self.clock() - started\n",
        ADMISSION, "a later chunk whose frames are made waits for the talker's forward toward the next frame",
    ),
    Mutation(
        "a_stream_speaks_until_its_talker_ends", "omnimtp/engine/core.py",
        " or (r.is_streamed and r.num_decoded < len(r.frames)))\n",
        ")\n",
        ("tests/test_admission.py::test_a_queued_stream_starts_once_the_last_chunks_before_it_are_decoded",),
        "a queued stream starts when the talker before it ends, with that stream's last chunks still to decode",
    ),
    Mutation(
        "first_chunks_alone_beside_urgent_ones", "omnimtp/engine/core.py",
        "        if first and urgent:  # one call",
        "        if False:  # one call",
        ("tests/test_admission.py::test_a_second_newcomers_first_chunk_shares_the_call_of_the_firsts_next_chunk",),
        "a newcomer's first chunk has a call of its own before the chunks of listeners in their first steps",
    ),
    Mutation(
        "newcomers_next_chunks_after_the_others", "omnimtp/engine/core.py",
        "        yield from self._decode_blocks(urgent)\n        yield from self._decode_blocks(rest)\n",
        "        yield from self._decode_blocks(later)\n",
        ("tests/test_admission.py::test_a_newcomers_next_chunks_keep_the_place_of_its_first_in_the_step",),
        "a newcomer's next chunks are decoded in one call with every other later chunk, after its first",
    ),
    Mutation(
        "newcomers_hold_near_chunks", "omnimtp/engine/core.py",
        "        if lead is None or lead < 2 * self.step_s + decode_s + decode_s / growth:\n",
        "        if lead is None or lead < 2 * self.step_s + decode_s + (0 if has_newcomers else decode_s / growth):\n",
        ADMISSION, "a chunk not far ahead waits for a queued newcomer and then stalls that newcomer's start",
    ),
    Mutation(
        "newcomer_waits_for_running_cohorts", "omnimtp/engine/core.py",
        "            yield from self._start(self._admit(admit_background=False))\n",
        "            pass\n",
        ADMISSION, "a request that came during the last step is admitted only after every running cohort thought",
    ),
    Mutation(
        "parked_stream_holds_capacity", "omnimtp/engine/core.py",
        "        return sum(r.has_speech and not r.is_parked\n",
        "        return sum(r.has_speech\n",
        ADMISSION, "a stream parked while it waits for text keeps its share of the real-time capacity",
    ),
    Mutation(
        "parked_stream_resumes_past_capacity", "omnimtp/engine/core.py",
        "            resumed = [r for r in self.running.values() if r.can_resume][: max(room, 0)]",
        "            resumed = [r for r in self.running.values() if r.can_resume][: max(num_free, 0)]",
        ADMISSION, "a parked stream whose text came resumes whatever the capacity",
    ),
    # --- Qwen3-ASR and Qwen3-ForcedAligner ------------------------------------------------------------
    Mutation(
        "asr_prompt_loses_the_assistant_line_end", "omnimtp/families/qwen3_asr.py",
        '"<|audio_end|><|im_end|>\\n<|im_start|>assistant\\n")',
        '"<|audio_end|><|im_end|>\\n<|im_start|>assistant")',
        QWEN3_ASR, "the ASR prompt's assistant turn opens without its line end",
    ),
    Mutation(
        "asr_audio_rows_of_a_wider_window", "omnimtp/families/qwen3_asr.py",
        "return _get_feat_extract_output_lengths(lengths, n_window).tolist()",
        "return _get_feat_extract_output_lengths(lengths, 2 * n_window).tolist()",
        QWEN3_ASR, "the prompt holds the audio rows of an encoder window twice the model's",
    ),
    Mutation(
        "asr_stream_rolls_back_one_token_less", "omnimtp/families/asr_stream.py",
        "            end = max(0, len(ids) - cut)",
        "            end = max(0, len(ids) - cut + 1)",
        QWEN3_ASR, "streaming recognition keeps one unstable reply token more in its prefix",
    ),
    Mutation(
        "asr_float_family_encodes_in_bf16", "omnimtp/families/qwen3_asr.py",
        "        self.thinker = encoder_thinker(thinker, quantize, int8_compute)",
        "        self.thinker = encoder_thinker(thinker, quantize or \"int8\", int8_compute)",
        QWEN3_ASR, "a float Qwen3-ASR encodes its audio with the bf16 encoder instead of the reference's",
    ),
    Mutation(
        "asr_bf16_encoder_linear_drops_its_bias", "omnimtp/models/qwen3_asr.py",
        "out = linear(x.to(torch.bfloat16), self.weight, self.bias, packed=self.packed, gemm=self.gemm)",
        "out = linear(x.to(torch.bfloat16), self.weight, None, packed=self.packed, gemm=self.gemm)",
        QWEN3_ASR, "the fast audio encoder's bf16 linears leave out their biases",
    ),
    Mutation(
        "encoder_fc1_rows_cast_to_float", "omnimtp/models/qwen3_asr.py",
        "            return out if self.bf16_out else out.float()",
        "            return out.float()",
        ("tests/test_qwen3_asr.py::test_fast_audio_encoder_keeps_rows_bf16_with_the_same_bits",),
        "the bf16 encoder casts fc1's widest rows to float32 and back again",
    ),
    Mutation(
        "encoder_norm_rows_float_for_each_reader", "omnimtp/models/qwen3_asr.py",
        "        return out.to(torch.bfloat16) if self.bf16_out else out",
        "        return out",
        ("tests/test_qwen3_asr.py::test_fast_audio_encoder_keeps_rows_bf16_with_the_same_bits",),
        "the bf16 encoder's norms hand q, k and v float32 rows, each rounded to bf16 again",
    ),
    Mutation(
        "onednn_packed_linear_drops_its_bias", "omnimtp/runtime/ops.py",
        'out = torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")',
        'out = torch.ops.mkldnn._linear_pointwise(x2d, packed, None, "none", [], "")',
        QWEN3_ASR, "a linear on oneDNN-packed bf16 weights leaves out its bias",
    ),
    Mutation(
        "aligner_float_encodes_in_bf16", "omnimtp/families/qwen3_aligner.py",
        "        self.thinker = encoder_thinker(thinker, quantize, int8_compute)",
        "        self.thinker = encoder_thinker(thinker, quantize or \"int8\", int8_compute)",
        QWEN3_ALIGNER, "a float aligner encodes its audio with the bf16 encoder instead of the reference's",
    ),
    Mutation(
        "causal_block_sees_every_column", "omnimtp/runtime/ops.py",
        "query.transpose(1, 2), keys, values, is_causal=True, scale=scale, enable_gqa=True",
        "query.transpose(1, 2), keys, values, is_causal=False, scale=scale, enable_gqa=True",
        ("tests/test_packed_decoder.py", *QWEN3_ALIGNER), "a square causal block attends to later positions too",
    ),
    Mutation(
        "causal_block_for_a_continued_block", "omnimtp/packed_decoder.py",
        "    if num_new > 1 and where.start == 0 and where.num_columns == num_new and not decoder.fp32_attention:",
        "    if num_new > 1 and where.start is not None and not decoder.fp32_attention:",
        ("tests/test_packed_decoder.py",), "a block continuing a slot's positions is taken for a square causal block",
    ),
    Mutation(
        "asr_quantized_keeps_its_float_encoder", "omnimtp/families/qwen3_asr.py",
        "        if self.thinker is not self.model.thinker:  # it encodes with its bf16 (or w8a8) copy\n"
        "            self.model.release_audio_encoder()\n"
        "        return self\n\n    @property\n    def device",
        "        return self\n\n    @property\n    def device",
        QWEN3_ASR, "a quantized Qwen3-ASR it loaded itself keeps its float audio encoder's matrices",
    ),
    Mutation(
        "aligner_gap_takes_the_right_neighbour_on_a_tie", "omnimtp/families/qwen3_aligner.py",
        "nearer_left = left is not None and (right is None or k - (i - 1) <= j - k)",
        "nearer_left = left is not None and (right is None or k - (i - 1) < j - k)",
        QWEN3_ALIGNER, "a repaired time bin equally far from both neighbours takes the right one",
    ),
    Mutation(
        "aligner_reads_the_slot_before_each_timestamp", "omnimtp/families/qwen3_aligner.py",
        "output_index=slots[None])",
        "output_index=slots[None] - 1)",
        QWEN3_ALIGNER, "the aligner classifies the position before each <timestamp> slot",
    ),
    Mutation(
        "transcription_words_on_half_the_audio", "omnimtp/server/routes/transcriptions.py",
        "return aligner.align((samples, rate), text, language)",
        "return aligner.align((samples[: len(samples) // 2], rate), text, language)",
        ASR_SERVER, "a transcript's word timestamps are aligned on the first half of its audio",
    ),
    Mutation(
        "speech_words_at_the_wrong_rate", "omnimtp/server/routes/speech.py",
        "for w in aligner.align((audio, sample_rate), text, language)]",
        "for w in aligner.align((audio, 16_000), text, language)]",
        ASR_SERVER, "generated speech (24 kHz) is aligned as if it were 16 kHz audio",
    ),
    Mutation(
        "auto_compiles_the_native_predictor", "omnimtp/talker/code_predictor.py",
        '            self.compile_mode = None if w4a8_step.step_table(self.weights.decoder) is not None else "frame"',
        '            self.compile_mode = "frame"',
        ("tests/test_w4a8_step.py",), "serve compiles a w4a8 predictor whose eager native step is as fast",
    ),
    Mutation(
        "serve_int8_compute_skips_the_asr_model", "omnimtp/server/build.py",
        "                                  torch_threads=getattr(args, \"threads\", None), quantize=args.quantize,\n"
        "                                  int8_compute=int8_compute, kv_dtype=kv_dtype)",
        "                                  torch_threads=getattr(args, \"threads\", None), quantize=args.quantize,\n"
        "                                  int8_compute=False, kv_dtype=kv_dtype)",
        ("tests/test_w8a8_linear.py",), "serve --int8-compute leaves the Qwen3-ASR served beside the model in float",
    ),
    Mutation(
        "japanese_split_at_spaces", "omnimtp/families/aligner_words.py",
        "        return _cleaned(nagisa.tagging(text).words)",
        "        return split_words(text)",
        ("tests/test_qwen3_aligner.py",), "Japanese split as a language with spaces",
    ),
    Mutation(
        "korean_without_the_word_list", "omnimtp/families/aligner_words.py",
        "    return tokenizer.LTokenizer(scores=scores)",
        "    return tokenizer.LTokenizer()",
        ("tests/test_qwen3_aligner.py",), "Korean words split without the reference's word list",
    ),
    Mutation(
        "no_warm_up_reply_for_tts", "omnimtp/engine/warm_up.py",
        "        if prompt_ids is not None or not hasattr(family, \"voice\"):",
        "        if True:",
        ("tests/test_warm_up.py",), "a Qwen3-TTS server's first request pays every stage's first run",
    ),
    Mutation(
        "w4a8_step_rotates_the_wrong_way", "omnimtp/runtime/kernels/small_batch_linear.c",
        "rotated[d] = v[d] * c[d] + v[(d + half) % D] * s[d];",
        "rotated[d] = v[d] * c[d] - v[(d + half) % D] * s[d];",
        ("tests/test_w4a8_step.py",), "the native w4a8 decode step's RoPE turns queries and keys the other way",
    ),
    Mutation(
        "w4a8_step_caches_every_row_at_the_first_rows_column", "omnimtp/runtime/kernels/small_batch_linear.c",
        "kv_head * head_stride + columns[r] * column_stride) * kv_size;",
        "kv_head * head_stride + columns[0] * column_stride) * kv_size;",
        ("tests/test_w4a8_step.py",), "the native w4a8 decode step writes every row's key and value at row 0's column",
    ),
    Mutation(
        "w4a8_step_drops_the_ragged_rows_mask", "omnimtp/runtime/w4a8_step.py",
        "        mask = mask[:, 0, 0].contiguous() if mask.dtype == torch.bool else mask[:, 0, 0] == 0  # [R or 1, S]",
        "        mask = None",
        ("tests/test_w4a8_step.py",), "ragged rows on the native w4a8 decode step attend past their own length",
    ),
    Mutation(
        "w4a8_step_block_rows_see_later_positions", "omnimtp/runtime/kernels/small_batch_linear.c",
        "    counts[r] = row_keys ? row_keys[r] : num_keys;",
        "    counts[r] = num_keys;",
        ("tests/test_w4a8_step.py",), "a causal block on the native w4a8 step attends to the block's later positions",
    ),
    Mutation(
        "full_server_reads_requests_before_refusing", "omnimtp/server/guard.py",
        '    QUEUED_ROUTES = ("/v1/chat/completions", "/v1/audio/speech")',
        "    QUEUED_ROUTES = ()",
        REFUSALS, "a full server parses, validates and tokenizes a chat or speech request before its 429",
    ),
    Mutation(
        "realtime_refusal_after_tokenizing", "omnimtp/server/routes/realtime/responses.py",
        "        await state.context.check_room()  # a full server refuses before the prompt is tokenized\n",
        "",
        REFUSALS, "a realtime response.create on a full server tokenizes the conversation before its queue_full",
    ),
    Mutation(
        "retry_after_rounded_to_whole_seconds", "omnimtp/server/admission.py",
        "        return max(_MIN_RETRY_AFTER_MS, min(1000 * _MAX_RETRY_AFTER_S, "
        "math.ceil(1000 * rounds * self._stream_s)))",
        "        return 1000 * max(1, min(_MAX_RETRY_AFTER_S, math.ceil(rounds * self._stream_s)))",
        REFUSALS, "a client refused while streams last a fraction of a second is told to wait whole seconds",
    ),
    Mutation(
        "every_refusal_logged", "omnimtp/server/serving.py",
        "        if now < self._next_at:\n",
        "        if False:\n",
        REFUSALS, "uvicorn's access log writes a line for every 429 of a flood",
    ),
    Mutation(
        "refusals_answered_without_pace", "omnimtp/server/guard.py",
        "        return max(0.0, turn - now - (self.burst - 1) / self.rate)",
        "        return 0.0",
        ("tests/test_refusals.py::test_a_flood_of_refused_requests_leaves_the_admitted_streams_steps_as_they_were",),
        "clients that ignore Retry-After are answered as fast as they send: the flood takes the engine's GIL time",
    ),
    # --- warm-up: prefetch of the mapped weights, the warm-up reply ----------------------------------------------
    Mutation(
        "prefetch_left_running_at_exit", "omnimtp/runtime/prefetch.py",
        "    for handle in list(_RUNNING):\n        handle.stop()",
        "    for handle in list(_RUNNING):\n        pass",
        ("tests/test_prefetch.py",), "a prefetch still reading when the interpreter exits is left running (an abort)",
    ),
    Mutation(
        "warm_before_the_warm_up_reply", "omnimtp/server/scheduler.py",
        "        if self.warm_up or self.warm_up_reply:\n            self._warm_stop.clear()",
        "        if metrics is not None:\n            metrics.warm.set(1)\n"
        "        if self.warm_up or self.warm_up_reply:\n            self._warm_stop.clear()",
        ("tests/test_warm_up.py",), "/metrics says the server is warm while its warm-up reply still runs",
    ),
    Mutation(
        "prefetch_reads_nothing", "omnimtp/runtime/prefetch.py",
        "                if libc.madvise(chunk, length, advice) != 0:",
        "                if False:",
        ("tests/test_prefetch.py",), "the prefetch thread never asks the kernel for the mapped pages",
    ),
    Mutation(
        "prefetch_reads_the_routed_experts_without_room", "omnimtp/runtime/prefetch.py",
        "                self.is_room_read = self.num_room_bytes <= self.memory_available - ROOM_RESERVE * total",
        "                self.is_room_read = True",
        ("tests/test_prefetch.py",), "the routed experts are read into the page cache whatever memory is available",
    ),
    Mutation(
        "prefetch_forces_the_thinkers_routed_experts", "omnimtp/runtime/decoder.py",
        "            skip |= ROUTED_EXPERT_FIELDS",
        "            pass",
        ("tests/test_prefetch.py",), "the prefetch reads every routed expert of the thinker",
    ),
    Mutation(
        "warm_up_reply_holds_a_users_request_back", "omnimtp/server/scheduler.py",
        "            self._end_warm_up_replies()  # a user's request comes first",
        "            pass",
        ("tests/test_warm_up.py",), "a user's request during the server's warm-up reply waits for it to finish",
    ),
    # --- w8a8: int8 GEMMs for many rows (Qwen3-ASR's and the aligner's int8_compute) -------------------------------
    Mutation(
        "w8a8_leaves_out_the_row_scale", "omnimtp/runtime/ops.py",
        "    return w8a8_sums(x_u8, weight).mul_(row_scales)",
        "    return w8a8_sums(x_u8, weight)",
        W8A8, "the w8a8 linear returns the integer sums times the weight scales, not times each row's scale",
    ),
    Mutation(
        "w8a8_one_scale_for_the_whole_batch", "omnimtp/runtime/ops.py",
        "    x_u8, row_scales = small_batch_linear.quantize_rows_u8(x)  # [M, K] uint8, [M, 1]",
        "    x_u8, row_scales = small_batch_linear.quantize_rows_u8(x.reshape(1, -1))\n"
        "    x_u8, row_scales = x_u8.view_as(x), row_scales.expand(x.shape[0], 1)",
        W8A8, "the w8a8 linear quantizes the batch with one scale: a row's values depend on the other rows",
    ),
    Mutation(
        "w8a8_rows_truncated_not_rounded", "omnimtp/runtime/kernels/small_batch_linear.c",
        "    __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));\n"
        "    r = _mm256_add_epi32(",
        "    __m256i r = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));\n"
        "    r = _mm256_add_epi32(",
        W8A8, "the w8a8 row quantizer truncates toward zero instead of rounding to nearest",
    ),
    Mutation(
        "w8a8_rows_truncated_not_rounded_16_lanes", "omnimtp/runtime/kernels/small_batch_linear.c",
        "    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inverse));",
        "    __m512i r = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inverse));",
        W8A8, "the w8a8 row quantizer's 16-lane steps truncate toward zero instead of rounding to nearest",
    ),
    Mutation(
        "w8a8_rows_maximum_of_the_first_lanes", "omnimtp/runtime/kernels/small_batch_linear.c",
        "  float amax = _mm512_reduce_max_ps(top);",
        "  float amax = _mm512_cvtss_f32(top);",
        W8A8, "the w8a8 row quantizer's scale from one lane's maximum, not the row's",
    ),
    Mutation(
        "w8a8_conv_patches_ignore_the_padding", "omnimtp/runtime/kernels/small_batch_linear.c",
        "          const int64_t w = wo * sw - pw + j;",
        "          const int64_t w = wo * sw + j;",
        W8A8_CONV, "the w8a8 convolution's patch rows start at the wrong column: padding not where torch has it",
    ),
    Mutation(
        "w8a8_conv_blocks_read_the_first_rows", "omnimtp/runtime/kernels/small_batch_linear.c",
        "      const int64_t r = row0 + m, b = r / (Ho * Wo)",
        "      const int64_t r = m, b = r / (Ho * Wo)",
        W8A8_CONV, "each block of the w8a8 convolution quantizes the first patches: outputs depend on the blocking",
    ),
    Mutation(
        "w8a8_encoder_first_conv_channels_first", "omnimtp/models/qwen3_asr.py",
        "        self.conv2d1 = Bf16Conv2d(tower.conv2d1, channels_last=True, gelu=True)",
        "        self.conv2d1 = Bf16Conv2d(tower.conv2d1, gelu=True)",
        W8A8_CONV, "the int8_compute encoder's first convolution hands the next one channels-first rows to reorder",
    ),
    Mutation(
        "w8a8_conv_drops_the_bias", "omnimtp/runtime/ops.py",
        "        encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, gelu, rows[row0:row0 + num_rows])",
        "        encoder_epilogue.scale_bias_gelu(sums, row_scales, None, gelu, rows[row0:row0 + num_rows])",
        W8A8_CONV, "the w8a8 convolution leaves out its bias",
    ),
    # --- the int8_compute audio encoder: its GEMMs' fused output pass and its windows on the bf16 kernel ----------
    Mutation(
        "encoder_epilogue_skips_gelu", "omnimtp/runtime/kernels/encoder_epilogue.c",
        "  if (gelu) y = gelu16(y);",
        "  (void)gelu;",
        ENCODER_EPILOGUE + W8A8_CONV, "the int8 GEMM's output pass leaves out the GELU it was asked for",
    ),
    Mutation(
        "encoder_epilogue_tanh_gelu", "omnimtp/runtime/kernels/encoder_epilogue.c",
        "  if (gelu) y = gelu16(y);",
        "  if (gelu) {\n"
        "    float v[16];\n"
        "    _mm512_storeu_ps(v, y);\n"
        "    for (int i = 0; i < 16; ++i)\n"
        "      v[i] = 0.5f * v[i] *\n"
        "             (1.0f + __builtin_tanhf(0.7978845608f * (v[i] + 0.044715f * v[i] * v[i] * v[i])));\n"
        "    y = _mm512_loadu_ps(v);\n"
        "  }",
        ENCODER_EPILOGUE, "the encoder's fused GELU is the tanh approximation, not the model's exact (erf) GELU",
    ),
    Mutation(
        "encoder_epilogue_fused_multiply_add", "omnimtp/runtime/kernels/encoder_epilogue.c",
        "  if (bias)\n"
        "    y = _mm512_add_round_ps(y, whole ? _mm512_loadu_ps(bias) : _mm512_maskz_loadu_ps(lanes, bias), "
        "ROUND_NEAREST);",
        "  if (bias)\n"
        "    y = _mm512_fmadd_ps(whole ? _mm512_loadu_ps(sums) : _mm512_maskz_loadu_ps(lanes, sums), scale,\n"
        "                        whole ? _mm512_loadu_ps(bias) : _mm512_maskz_loadu_ps(lanes, bias));",
        ENCODER_EPILOGUE, "the row scale and the bias in one fused multiply-add: not the bits of torch's mul_ and add_",
    ),
    Mutation(
        "encoder_u8_rows_truncated", "omnimtp/runtime/kernels/encoder_epilogue.c",
        "    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(y + n), inverse));",
        "    __m512i r = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_loadu_ps(y + n), inverse));",
        ENCODER_EPILOGUE, "fc1's rows handed to fc2 are truncated toward zero, not rounded as the row quantizer rounds",
    ),
    Mutation(
        "encoder_u8_rows_before_gelu", "omnimtp/runtime/kernels/encoder_epilogue.c",
        "        epilogue16(sums + m * sum_stride + n, scale, bias ? bias + n : NULL, gelu, row, n, 0, 0xFFFF);",
        "        epilogue16(sums + m * sum_stride + n, scale, bias ? bias + n : NULL, 0, row, n, 0, 0xFFFF);",
        ENCODER_EPILOGUE, "fc1's rows are quantized for fc2 without their GELU",
    ),
    Mutation(
        "encoder_conv_out_columns_not_permuted", "omnimtp/models/qwen3_asr.py",
        "        weight = module.weight.detach().float().view(module.out_features, channels, self.frequencies, 1)",
        "        weight = module.weight.detach().float().view(module.out_features, self.frequencies, channels, 1)\n"
        "        weight = weight.transpose(1, 2)",
        ENCODER_EPILOGUE, "conv_out read as a convolution multiplies the frequencies' rows by the wrong weight columns",
    ),
    Mutation(
        "encoder_first_conv_tanh_gelu", "omnimtp/models/qwen3_asr.py",
        "list(self.padding), list(self.stride), [1, 1], 1, \"gelu\", [], \"none\")",
        "list(self.padding), list(self.stride), [1, 1], 1, \"gelu\", [], \"tanh\")",
        W8A8_CONV, "the encoder's first convolution applies the tanh approximation of GELU, not the exact one",
    ),
    Mutation(
        "encoder_window_sees_the_padding", "omnimtp/models/qwen3_asr.py",
        "        key_counts = torch.tensor(lengths, dtype=torch.int64)[:, None].expand(-1, window)  # [W, window]",
        "        key_counts = torch.full((len(lengths), window), window, dtype=torch.int64)",
        ENCODER_EPILOGUE, "the encoder's shorter last window attends to the padding rows after it",
    ),
    Mutation(
        "encoder_windows_see_each_other", "omnimtp/models/qwen3_asr.py",
        "        qkv = buffer.view(len(lengths), window, 3, self.num_heads, self.head_dim)",
        "        qkv = buffer.view(1, len(lengths) * window, 3, self.num_heads, self.head_dim)\n"
        "        lengths, window = [sum(lengths)] if at is None else [len(lengths) * window], len(lengths) * window",
        ENCODER_EPILOGUE, "the encoder's windows attend across each other: one window of the whole audio",
    ),
    Mutation(
        "encoder_attention_stays_on_sdpa", "omnimtp/models/qwen3_asr.py",
        "        return (self.head_dim % 16 == 0 and self.head_dim <= bf16_attention.MAX_HEAD_DIM\n"
        "                and bf16_attention.available())",
        "        return False",
        ENCODER_EPILOGUE, "the int8_compute encoder's windows stay on fp32 SDPA",
    ),
    Mutation(
        "asr_prefill_runs_on_the_decode_weights", "omnimtp/thinker.py",
        "        self.prefill_decoder = prefill_decoder or self.decoder",
        "        self.prefill_decoder = self.decoder",
        W8A8, "Qwen3-ASR's int8_compute leaves its prompts' forwards on the decode steps' weights",
    ),
]


def _tree_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True, capture_output=True
    ).stdout.decode()
    return [name for name in out.split("\0") if name and (repo / name).is_file()]


def make_scratch_copy(repo: Path, scratch: Path) -> None:
    for name in _tree_files(repo):
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, target)


def _env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    return env


def check_import_path(scratch: Path) -> str:
    """The scratch copy's omnimtp must shadow the editable install of the repository."""
    out = subprocess.run(
        [sys.executable, "-c", "import omnimtp; print(omnimtp.__file__)"],
        cwd=scratch, env=_env(scratch), check=True, capture_output=True, text=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"mutation_check: the scratch run imports omnimtp from {out}, not from {scratch}")
    return out


def check_snippet(mutation: Mutation, source: str) -> None:
    count = source.count(mutation.old)
    if count != 1:
        raise SystemExit(
            f"mutation_check: {mutation.name}: the old snippet occurs {count} times in {mutation.path} (must be once)"
        )


def run_pytest(scratch: Path, tests: list[str], timeout_s: float) -> tuple[int | None, float, str]:
    """→ (exit code, or None on timeout; seconds; output)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=_env(scratch), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        output = error.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        return None, time.perf_counter() - start, output
    return proc.returncode, time.perf_counter() - start, proc.stdout + proc.stderr


def first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
    return match.group(1) if match else ""


def run_mutation(scratch: Path, mutation: Mutation, timeout_s: float) -> dict:
    path = scratch / mutation.path
    original = path.read_text()
    mutated = original.replace(mutation.old, mutation.new, 1)
    if path.suffix == ".py":  # a mutation must be a bug, not a syntax error (a C kernel is compiled by its tests)
        compile(mutated, str(path), "exec")
    path.write_text(mutated)
    try:
        code, seconds, output = run_pytest(scratch, list(mutation.tests), timeout_s)
    finally:
        path.write_text(original)
    if code is None:
        verdict = "caught (timeout)"
    elif code in (1, 2):
        verdict = "caught"
    elif code == 0:
        verdict = "SURVIVED"
    else:
        raise SystemExit(f"mutation_check: {mutation.name}: pytest exited {code}:\n{output[-3000:]}")
    return {
        "name": mutation.name, "file": mutation.path, "tests": list(mutation.tests), "verdict": verdict,
        "caught": verdict != "SURVIVED", "seconds": round(seconds, 1), "first_failure": first_failure(output),
        "description": mutation.description,
    }


def markdown_table(results: list[dict]) -> str:
    lines = ["| mutation | file | tests run | caught? | seconds | first failing test |", "|---|---|---|---|---|---|"]
    for r in results:
        tests = ", ".join(Path(t).name for t in r["tests"])
        failure = r["first_failure"].split("/")[-1] if r["first_failure"] else ""
        lines.append(
            f"| {r['name']} | {r['file']} | {tests} | {r['verdict']} | {r['seconds']:.0f} | {failure} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument(
        "--check-snippets", action="store_true", help="check that every old snippet occurs once in its file, and exit"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--tests", nargs="+", metavar="PATH", help="run these tests for every selected mutation instead of its own"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    args = parser.parse_args(argv)
    # SIGTERM as an exception: the running pytest is killed and the scratch directory removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    by_name = {m.name: m for m in MUTATIONS}
    if len(by_name) != len(MUTATIONS):
        raise SystemExit("mutation_check: duplicate mutation names")
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:45s} {m.path:36s} {m.description}")
        return 0
    unknown = [name for name in args.only or [] if name not in by_name]
    if unknown:
        raise SystemExit(f"mutation_check: unknown mutations {unknown}; see --list")
    selected = [by_name[name] for name in args.only] if args.only else MUTATIONS
    if args.tests:
        selected = [replace(m, tests=tuple(args.tests)) for m in selected]
    for m in selected:
        check_snippet(m, (REPO / m.path).read_text())
    if args.check_snippets:
        print(f"mutation_check: {len(selected)} snippets, each once in its file")
        return 0

    with tempfile.TemporaryDirectory(prefix="omnimtp-mutation-") as tmp:
        scratch = Path(tmp) / "repo"
        make_scratch_copy(REPO, scratch)
        for m in selected:  # the copy is what gets mutated: check it too
            check_snippet(m, (scratch / m.path).read_text())
        print(f"scratch copy: {scratch} (omnimtp imported from {check_import_path(scratch)})", file=sys.stderr)

        baseline_tests = sorted({t for m in selected for t in m.tests})
        code, seconds, output = run_pytest(scratch, baseline_tests, args.timeout)
        print(f"baseline: {' '.join(baseline_tests)}: exit {code} in {seconds:.0f} s", file=sys.stderr)
        if code != 0:
            print(output[-5000:], file=sys.stderr)
            raise SystemExit("mutation_check: the unmutated baseline is not green")

        results = []
        for m in selected:
            result = run_mutation(scratch, m, args.timeout)
            print(f"{m.name}: {result['verdict']} in {result['seconds']:.0f} s {result['first_failure']}",
                  file=sys.stderr)
            results.append(result)

    print(markdown_table(results))
    survivors = [r["name"] for r in results if not r["caught"]]
    print(f"\n{len(results) - len(survivors)} of {len(results)} mutations caught; baseline {seconds:.0f} s", end="")
    print(f"; survived: {', '.join(survivors)}" if survivors else "")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline_s": round(seconds, 1), "results": results}, indent=2) + "\n")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
