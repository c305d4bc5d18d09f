"""Attention of many positions a row (a prompt's forward): omnimtp's bf16 kernel (`bf16_attention`) against torch's
SDPA in fp32, alternated in one process, and what it changes in the forced aligner's timestamps.

Timing: per `--positions` count P, one layer's causal attention over P positions (query [1, P, Nq, D]; the keys and
values [1, Nkv, P, D] views of a cache as the decoder holds them; `--heads`, default Qwen3-ASR-0.6B's and the
aligner's 16 / 8 / 128), and the same with every key visible (`full`); the kernel and SDPA take turns `--rounds`
times; the median ms of each, the median of the per-round ratios, GFLOP/s (causal: half the P² products), and the
error against fp32 SDPA (‖Δ‖ / ‖SDPA‖ over the output). Default P: 812 (a 60 s transcription's prompt) and 1311 (the
aligner's forward over 60 s and 150 words).

`--aligner-error`: the forced aligner at its released widths (random weights, `--seconds` of noise and `--words`
words, as `benchmarks/asr_speed.py` makes them, tokenized by its BPE tokenizer) in fp32 and with `int8_compute`,
its attention on SDPA and on the kernel: the relative error of the final rows at the timestamp slots against
fp32's, and the share of time bins equal to fp32's.

    python benchmarks/many_row_attention.py [--positions 812 1311] [--rounds 15] [--threads 2] [--aligner-error]
    python benchmarks/many_row_attention.py --quick     # small shapes, a check that it runs (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from omnimtp.runtime import ops  # noqa: E402
from omnimtp.runtime.kernels import bf16_attention  # noqa: E402


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def attention_rates(positions: int, heads: tuple[int, int, int], rounds: int) -> dict:
    """The kernel and SDPA alternated on one layer's causal and full attention over `positions` positions."""
    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(positions)
    query = torch.randn(1, positions, num_heads, head_dim, generator=generator)
    cache = torch.randn(2, 1, num_kv_heads, positions + 64, head_dim, generator=generator)
    keys, values = cache[0][:, :, :positions], cache[1][:, :, :positions]
    scale = head_dim**-0.5
    entry = {}
    for mask, counts in (("causal", bf16_attention.causal_key_counts(positions, positions)),
                         ("full", torch.full((1, positions), positions))):
        def ours(counts=counts):
            return bf16_attention.bf16_attention(query, keys, values, counts, scale)

        def sdpa(is_causal=mask == "causal"):
            return F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, is_causal=is_causal,
                                                  scale=scale, enable_gqa=True)

        expected = sdpa().transpose(1, 2).reshape(1, positions, -1)
        error = float((ours() - expected).norm() / expected.norm())
        times = {"ours": [], "sdpa": []}
        for _ in range(rounds):
            times["ours"].append(_timed(ours))
            times["sdpa"].append(_timed(sdpa))
        ratios = sorted(s / o for s, o in zip(times["sdpa"], times["ours"], strict=True))
        flops = 4 * num_heads * head_dim * positions * positions * (0.5 if mask == "causal" else 1.0)
        medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        entry[mask] = {"ours_ms": 1e3 * medians["ours"], "sdpa_ms": 1e3 * medians["sdpa"],
                       "ratio": ratios[len(ratios) // 2], "ours_gflop_s": flops / medians["ours"] / 1e9,
                       "sdpa_gflop_s": flops / medians["sdpa"] / 1e9, "rel_error": error}
    return entry


def aligner_error(seconds: float, words: int, quick: bool) -> dict:
    """The aligner's timestamp rows and bins with int8_compute (attention on SDPA, then on the kernel) against fp32."""
    from asr_speed import _audio, _model, _transcript, bpe_tokenizer, train_bpe
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
    from omnimtp.media import MediaLimits
    from omnimtp.models.qwen3_asr import asr_byte_tokenizer
    from omnimtp.thinker import multimodal_prefill

    samples, text = _audio(seconds), _transcript(words)
    limits = MediaLimits(max_audio_seconds=seconds + 1)
    model = _model(True, quick)
    exact = Qwen3ForcedAligner(model, asr_byte_tokenizer())
    fast = Qwen3ForcedAligner(model, asr_byte_tokenizer(), int8_compute=True)
    with tempfile.TemporaryDirectory() as scratch:  # the words as many tokens as the released tokenizer makes them
        path = Path(scratch) / "bpe.json"
        path.write_text(train_bpe(quick))
        exact.tokenizer = fast.tokenizer = bpe_tokenizer(str(path))

    def slot_rows(aligner) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the final rows at the timestamp slots, their bins, the forward's positions)."""
        media = aligner.processor.features(samples)
        config = aligner.model.thinker.config.audio_config
        num_rows = int(_get_feat_extract_output_lengths(media.audio_lengths, config.n_window)[0])
        ids = aligner.prompt_ids(aligner.words(text, "en"), num_rows)
        with torch.no_grad():
            prefill = multimodal_prefill(aligner.thinker, ids, media, aligner.decoder.device)
            rows = aligner.timestamp_rows(ids, prefill.embeds)
        return rows, torch.from_numpy(aligner._bins(ids, media)), len(ids)

    exact.align(samples[:8000], "warm up", "en", limits)
    rows, bins, positions = slot_rows(exact)
    result = {"positions": positions, "timestamp_slots": int(bins.numel())}
    original = ops._bf16_many_rows
    for name, on_kernel in (("int8_compute_sdpa", False), ("int8_compute", True)):
        ops._bf16_many_rows = original if on_kernel else (lambda *args: None)
        try:
            got_rows, got_bins, _ = slot_rows(fast)
        finally:
            ops._bf16_many_rows = original
        result[name] = {"rows_rel_error": float((got_rows - rows).norm() / rows.norm()),
                        "bins_equal": float((got_bins == bins).float().mean())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[812, 1311])
    parser.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("NQ", "NKV", "D"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--aligner-error", action="store_true")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (a test's run)")
    parser.add_argument("--out", default="benchmarks/results/many_row_attention.json")
    args = parser.parse_args()
    if not bf16_attention.available():
        sys.exit(f"the bf16 attention kernel is not available here: {bf16_attention.unavailable_reason()}")
    if args.quick:
        args.positions, args.rounds, args.seconds, args.words = [100], 3, 3.0, 10
    torch.set_num_threads(args.threads)
    results = {"platform": platform.processor() or platform.machine(), "threads": args.threads,
               "heads": args.heads, "positions": {}}
    for positions in args.positions:
        entry = attention_rates(positions, tuple(args.heads), args.rounds)
        results["positions"][str(positions)] = entry
        for mask, e in entry.items():
            print(f"{positions} positions, {mask}: ours {e['ours_ms']:.1f} ms ({e['ours_gflop_s']:.0f} GFLOP/s), SDPA "
                  f"{e['sdpa_ms']:.1f} ms ({e['sdpa_gflop_s']:.0f}); median ratio {e['ratio']:.2f}x; "
                  f"‖Δ‖ / ‖SDPA‖ {e['rel_error']:.1e}")
    if args.aligner_error:
        results["aligner_error"] = errors = aligner_error(args.seconds, args.words, args.quick)
        for name in ("int8_compute_sdpa", "int8_compute"):
            print(f"aligner {name}: timestamp rows {100 * errors[name]['rows_rel_error']:.1f} % off fp32's, "
                  f"{100 * errors[name]['bins_equal']:.0f} % of {errors['timestamp_slots']} bins equal")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
