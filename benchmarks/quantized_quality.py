"""What weight-only int8 / int4, w4a8 and a bf16 codec cost in quality, measured where it can be measured honestly here.

No released weights can be downloaded on this box, so quality is measured on the trained demo models, and only
the numeric error on the real-width Qwen3-TTS checkpoint (random weights):

- the demo LM (`omnimtp/data/demo_lm`, a trained Glm4Moe whose target layers are all dense) and the demo
  Qwen3-Omni thinker (`omnimtp/data/demo_omni`, dense; its quantized modes with the int8 LM head the engine runs,
  and fp32 layers with that head alone): over their held-out prompts (stdlib code none of them saw), per mode,
  greedy token agreement with fp32 (`--new-tokens` tokens after each prompt's first `--prefix-tokens`: the share
  of positions where both pick the same token, and the mean number of tokens before the first difference) and the
  perplexity of the held-out text under teacher forcing, next to fp32's;
- the Qwen3-TTS talker at the released widths (`--tts-model DIR`, or the checkpoint `tts_realtime.py` builds
  and caches): under teacher forcing on `--tts-frames` frames of seeded random codes (each input row the sum
  of the frame's 16 code embeddings and the text pad row, the talker's input once the text is spoken), the
  codec head logits' relative error (‖Δ‖ / ‖fp32‖ over all rows) and the codebook-0 top-1 agreement
  (argmax over the 2048 code ids) with fp32, and the int8 text projection's rows' relative error;
- its code predictor, on the same frames: each frame's [talker state, the embeddings of codes 0..14] teacher
  forced, the 15 residual heads' logits as the engine runs them quantized (layers in the mode, heads in int8:
  `PredictorWeights.quantized`), and with the heads in the mode too, against fp32: relative error and top-1
  agreement over the 15 codebooks (attention through SDPA, which takes the teacher-forced causal mask; the
  engine's own fp32 attention gives the same values up to rounding).

- its 12 Hz decoder with the conv stack in bf16 (`codec_dtype="bfloat16"`) against fp32, on the same number of
  seeded random frames: the SNR of the audio, one-shot and streamed in the engine's chunks.

- routed experts: the GLM-5 demo (`omnimtp/data/demo_glm5`, glm_moe_dsa, the one trained checkpoint here with
  MoE layers: three of its four layers, 4 routed experts, top-2) through transformers' forward with each MoE layer's
  routed experts replaced by omnimtp's quantized ones (`ops.quantize_experts`, `moe.quantized_expert_outputs`:
  what a quantized packed MoE layer runs) and everything else float, so the figures are the experts' error alone:
  greedy agreement and perplexity as above, over its held-out prompts.

Everything else runs on omnimtp's packed decoder (the engine's forward), fp32 against `PackedDecoder.quantized`.

    python benchmarks/quantized_quality.py [--quick] [--threads 2] [--no-tts] [--tts-size 0.6b] [--out q.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime.ops import QUANTIZE_MODES, linear, quantize_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))


def final_states(decoder: PackedDecoder, embeds: torch.Tensor) -> torch.Tensor:
    """embeds [T, H] from position 0 → every position's row after the final norm [T, H]."""
    cache = KVCache(decoder, 1, embeds.shape[0] + 1)
    return decoder_forward(decoder, cache, embeds[None], [0], all_final=True).final[0]


def head_logits(decoder: PackedDecoder, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] → logits, by the decoder's int8 head where it has one (what a quantized thinker runs)."""
    if decoder.quantized_lm_head is not None:
        return linear(hidden, None, packed=decoder.quantized_lm_head)
    return hidden @ lm_head.T


def greedy(decoder: PackedDecoder, embed: torch.Tensor, lm_head: torch.Tensor, ids: list[int], num_new: int):
    """num_new greedy tokens after ids on the packed decoder."""
    cache = KVCache(decoder, 1, len(ids) + num_new + 1)
    hidden = decoder_forward(decoder, cache, embed[torch.tensor(ids)][None], [0]).last_hidden  # [1, H]
    out = []
    for _ in range(num_new):
        token = int(head_logits(decoder, hidden[0], lm_head).argmax())
        out.append(token)
        hidden = decoder_forward(decoder, cache, embed[token][None, None], [0]).last_hidden
    return out


def summarize(result: dict, runs: dict, nll: dict, modes, num_new: int) -> dict:
    """result with fp32's perplexity and, per mode, the greedy agreement of its runs (per mode: each prompt's new
    tokens) with fp32's and its perplexity (nll: mean negative log-likelihood per mode)."""
    result["fp32_perplexity"] = math.exp(nll["fp32"])
    for mode in modes:
        same = sum(a == b for ref, got in zip(runs["fp32"], runs[mode], strict=True)
                   for a, b in zip(ref, got, strict=True))
        prefixes = [next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), num_new)
                    for ref, got in zip(runs["fp32"], runs[mode], strict=True)]
        result[mode] = {
            "greedy_agreement": same / (num_new * len(runs["fp32"])),
            "identical_runs": sum(p == num_new for p in prefixes),
            "mean_tokens_before_first_difference": sum(prefixes) / len(prefixes),
            "perplexity": math.exp(nll[mode]),
            "perplexity_change": math.exp(nll[mode] - nll["fp32"]) - 1,
        }
    return result


def lm_quality(name: str, decoder: PackedDecoder, embed, lm_head, texts: list[list[int]], modes, prefix: int,
               num_new: int, int8_head: bool = False) -> dict:
    """Greedy agreement and teacher-forced perplexity per mode against fp32 (see the module docstring). int8_head:
    each mode's logits from the int8 head a quantized thinker runs (`with_quantized_lm_head`), and one more
    variant, "fp32_layers_int8_head", the head's error alone."""
    decoders = {"fp32": decoder, **{mode: decoder.quantized(mode) for mode in modes}}
    if int8_head:
        decoders = {mode: d if mode == "fp32" else d.with_quantized_lm_head(lm_head) for mode, d in decoders.items()}
        decoders["fp32_layers_int8_head"] = decoder.with_quantized_lm_head(lm_head)
        modes = [*modes, "fp32_layers_int8_head"]
    result = {"model": name, "num_prompts": len(texts), "prefix_tokens": prefix, "new_tokens": num_new}
    with torch.no_grad():
        runs = {mode: [greedy(d, embed, lm_head, ids[:prefix], num_new) for ids in texts]
                for mode, d in decoders.items()}
        nll = {}
        for mode, d in decoders.items():
            total, count = 0.0, 0
            for ids in texts:
                logits = head_logits(d, final_states(d, embed[torch.tensor(ids)]), lm_head)  # [T, V]
                total += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
                count += len(ids) - 1
            nll[mode] = total / count
    return summarize(result, runs, nll, modes, num_new)


def demo_lm(modes, num_prompts: int, prefix: int, num_new: int, max_tokens: int) -> dict:
    from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model

    target, _, tokenizer = load_demo_model("lm")
    decoder = PackedDecoder.from_causal_lm(target)
    texts = [tokenizer.encode(t)[:max_tokens] for t in demo_heldout_prompts("lm")[:num_prompts]]
    return lm_quality("demo LM (Glm4Moe)", decoder, decoder.embed, decoder.lm_head, texts, modes, prefix, num_new)


def demo_omni_thinker(modes, num_prompts: int, prefix: int, num_new: int, max_tokens: int) -> dict:
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnimtp.mtp.demo import demo_omni_dir, demo_omni_prompts

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(demo_omni_dir(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_omni_dir())
    thinker = model.thinker
    decoder = PackedDecoder.from_module(thinker.model.language_model)
    texts = [tokenizer.encode(t)[:max_tokens] for t in demo_omni_prompts()[:num_prompts]]
    embed, lm_head = thinker.model.language_model.embed_tokens.weight.detach(), thinker.lm_head.weight.detach()
    return lm_quality("demo Qwen3-Omni thinker", decoder, embed, lm_head, texts, modes, prefix, num_new,
                      int8_head=True)


class _QuantizedExperts(torch.nn.Module):
    """A transformers experts module's forward (tokens, top-k ids, top-k weights → [N, H]) on omnimtp's quantized
    experts."""

    def __init__(self, experts, mode: str):
        super().__init__()
        from omnimtp.runtime.ops import quantize_experts

        self.gate_up = quantize_experts(experts.gate_up_proj.detach(), mode)
        self.down = quantize_experts(experts.down_proj.detach(), mode)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from omnimtp.runtime.moe import combine, quantized_expert_outputs

        outputs = quantized_expert_outputs(hidden_states, top_k_index, self.gate_up, self.down)
        return combine(outputs, top_k_weights, hidden_states.dtype)


def demo_glm5_experts(modes, num_prompts: int, prefix: int, num_new: int, max_tokens: int) -> dict:
    """Greedy agreement and perplexity of the GLM-5 demo with its routed experts quantized (module docstring)."""
    from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model

    target, _, tokenizer = load_demo_model("glm5")
    texts = [tokenizer.encode(t)[:max_tokens] for t in demo_heldout_prompts("glm5")[:num_prompts]]
    sparse = [layer.mlp for layer in target.model.layers if hasattr(layer.mlp, "experts")]
    originals = [mlp.experts for mlp in sparse]
    result = {"model": f"GLM-5 demo (glm_moe_dsa), routed experts of {len(sparse)} MoE layers",
              "num_prompts": len(texts), "prefix_tokens": prefix, "new_tokens": num_new}
    runs, nll = {}, {}
    for mode in ["fp32", *modes]:
        for mlp, experts in zip(sparse, originals, strict=True):
            mlp.experts = experts if mode == "fp32" else _QuantizedExperts(experts, mode)
        with torch.no_grad():
            runs[mode] = [
                target.generate(torch.tensor([ids[:prefix]]), max_new_tokens=num_new, min_new_tokens=num_new,
                                do_sample=False)[0, prefix:].tolist()
                for ids in texts
            ]
            total, count = 0.0, 0
            for ids in texts:
                logits = target(torch.tensor([ids])).logits[0]  # [T, V]
                total += F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="sum").item()
                count += len(ids) - 1
            nll[mode] = total / count
    for mlp, experts in zip(sparse, originals, strict=True):
        mlp.experts = experts
    return summarize(result, runs, nll, modes, num_new)


def tts_talker(path: str, modes, num_frames: int) -> dict:
    """The talker's codec-head logits under teacher forcing, quantized vs fp32 (see the module docstring)."""
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily

    family = Qwen3TTSFamily.from_pretrained(path)  # fp32; its float weights stay (not quantized)
    talker, cp = family.talker, family.talker.code_predictor
    vocab = talker.config.vocab_size
    codebook_size = cp.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, codebook_size, (num_frames, cp.config.num_code_groups), generator=generator)
    with torch.no_grad():
        rows = talker.model.codec_embedding(codes[:, 0]) + family.tts_pad_embed  # [T, H]
        for g in range(1, cp.config.num_code_groups):
            rows = rows + cp.model.codec_embedding[g - 1](codes[:, g])
        logits = {"fp32": talker.codec_head(final_states(family.talker_decoder, rows)).float()}  # [T, V]
        for mode in modes:
            logits[mode] = talker.codec_head(final_states(family.talker_decoder.quantized(mode), rows)).float()
    reference = logits["fp32"]
    top1 = reference[:, :codebook_size].argmax(-1)
    result = {"model": f"Qwen3-TTS talker at {path}", "frames": num_frames, "vocab_size": vocab,
              "hidden_size": talker.config.hidden_size, "num_layers": talker.config.num_hidden_layers}
    with torch.no_grad():  # the text projection, int8 in both modes: its rows for num_frames random text ids
        embeds = talker.model.text_embedding(torch.randint(0, talker.model.text_embedding.num_embeddings,
                                                           (num_frames,), generator=generator))
        mlp = talker.text_projection
        hidden = embeds
        for fc, act in ((mlp.linear_fc1, F.silu), (mlp.linear_fc2, lambda t: t)):
            hidden = act(linear(hidden, None, fc.bias, packed=quantize_weight(fc.weight, "int8")))
        rows = mlp(embeds)
        result["text_projection_int8_relative_error"] = ((hidden - rows).norm() / rows.norm()).item()
    for mode in modes:
        got = logits[mode]
        result[mode] = {
            "logits_relative_error": ((got - reference).norm() / reference.norm()).item(),
            "codebook0_top1_agreement": (got[:, :codebook_size].argmax(-1) == top1).float().mean().item(),
        }
    return result


def tts_codec(path: str, num_frames: int) -> dict:
    """The 12 Hz decoder with its conv stack in bf16 (`codec_dtype="bfloat16"`) against fp32 on seeded random
    codes: the SNR of its audio (10·log10(Σ fp32² / Σ (bf16 − fp32)²)), one-shot and streamed as the engine
    streams (a first chunk of one frame, then chunks of `EngineConfig.chunk_frames`)."""
    import numpy as np

    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder
    from omnimtp.engine.core import EngineConfig

    codec_path = os.path.join(path, "speech_tokenizer")
    decoders = {"fp32": SpeechTokenizerDecoder.from_pretrained(codec_path),
                "bf16": SpeechTokenizerDecoder.from_pretrained(codec_path).to_conv_dtype(torch.bfloat16)}
    codes = torch.randint(0, decoders["fp32"].codebook_size, (decoders["fp32"].num_quantizers, num_frames),
                          generator=torch.Generator().manual_seed(0))
    chunk = EngineConfig().chunk_frames
    bounds = [0, *range(1, num_frames, chunk), num_frames]
    audio = {}
    for name, decoder in decoders.items():
        stream = decoder.new_stream()
        audio[name] = decoder.decode(codes), np.concatenate(
            [decoder.decode_streams([stream], [codes[:, a:b]])[0] for a, b in zip(bounds, bounds[1:], strict=False)])

    def snr_db(actual, expected) -> float:
        expected = expected.astype(np.float64)
        return float(10 * np.log10((expected**2).sum() / ((actual.astype(np.float64) - expected) ** 2).sum()))

    return {"model": f"Qwen3-TTS 12 Hz decoder at {codec_path}", "frames": num_frames, "chunk_frames": chunk,
            "fp32_rms": float(np.sqrt((audio["fp32"][0].astype(np.float64) ** 2).mean())),
            "bf16_one_shot_snr_db": snr_db(audio["bf16"][0], audio["fp32"][0]),
            "bf16_streamed_snr_db": snr_db(audio["bf16"][1], audio["fp32"][1])}


def tts_code_predictor(path: str, modes, num_frames: int) -> dict:
    """The code predictor's 15 residual heads under teacher forcing, quantized vs fp32 (module docstring)."""
    from dataclasses import replace

    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.talker.code_predictor import _project, pack_predictor_weights

    family = Qwen3TTSFamily.from_pretrained(path)
    talker, cp = family.talker, family.talker.code_predictor
    groups, codebook_size = cp.config.num_code_groups, cp.config.vocab_size
    codes = torch.randint(0, codebook_size, (num_frames, groups), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rows = talker.model.codec_embedding(codes[:, 0]) + family.tts_pad_embed  # [T, H]
        embeds = [talker.model.codec_embedding(codes[:, 0])]
        for g in range(1, groups):
            rows = rows + cp.model.codec_embedding[g - 1](codes[:, g])
            embeds.append(cp.model.codec_embedding[g - 1](codes[:, g]))
        talker_states = final_states(family.talker_decoder, rows)  # [T, H]
        inputs = torch.stack([talker_states, *embeds[: groups - 1]], dim=1)  # [T, G, H]: h, E0(c0)..E14(c14)
        weights = pack_predictor_weights(cp, torch.float32)
        weights = replace(weights, decoder=replace(weights.decoder, fp32_attention=False))

        def head_logits(decoder, heads) -> torch.Tensor:  # heads: G-1 (weight, packed) → [T, G-1, V]
            frames = []
            for frame in inputs:
                states = final_states(decoder, _project(weights, frame[None])[0])  # [G, H]: position j+1 → head j
                frames.append(torch.stack([linear(states[j + 1], *head) for j, head in enumerate(heads)]))
            return torch.stack(frames)

        float_heads = [(head, None, None) for head in weights.lm_heads]
        reference = head_logits(weights.decoder, float_heads)
        result = {"model": f"Qwen3-TTS code predictor at {path}", "frames": num_frames, "codebooks": groups - 1,
                  "vocab_size": codebook_size, "num_layers": len(weights.decoder.layers)}
        for mode in modes:
            quantized = weights.quantized(mode)
            quantized = replace(quantized, decoder=replace(quantized.decoder, fp32_attention=False))
            variants = {"heads_int8": [(None, None, head) for head in quantized.quantized_lm_heads]}
            if mode != "int8":
                variants[f"heads_{mode}"] = [(None, None, quantize_weight(h, mode)) for h in weights.lm_heads]
            result[mode] = {}
            for name, heads in variants.items():
                got = head_logits(quantized.decoder, heads)
                result[mode][name] = {
                    "logits_relative_error": ((got - reference).norm() / reference.norm()).item(),
                    "top1_agreement": (got.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 8 tokens, the tiny TTS (a check it runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(QUANTIZE_MODES), choices=QUANTIZE_MODES)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256, help="held-out tokens per prompt for perplexity")
    parser.add_argument("--no-tts", action="store_true")
    parser.add_argument("--tts-model", default=None, help="a Qwen3-TTS checkpoint (default: tts_realtime.py's)")
    parser.add_argument("--tts-size", default="0.6b", choices=("tiny", "0.6b", "1.7b"))
    parser.add_argument("--tts-frames", type=int, default=64)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.num_prompts, args.prefix_tokens, args.new_tokens, args.max_tokens = 2, 16, 8, 48
        args.tts_size, args.tts_frames = "tiny", 8
    started = time.perf_counter()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
               "torch": torch.__version__, "modes": args.modes}
    options = (args.modes, args.num_prompts, args.prefix_tokens, args.new_tokens, args.max_tokens)
    for key, measure in (("demo_lm", demo_lm), ("demo_omni_thinker", demo_omni_thinker),
                         ("demo_glm5_experts", demo_glm5_experts)):
        entry = results[key] = measure(*options)
        print(f"{entry['model']}: fp32 perplexity {entry['fp32_perplexity']:.3f} over {entry['num_prompts']} prompts")
        for mode in [m for m in entry if m in args.modes or m == "fp32_layers_int8_head"]:
            e = entry[mode]
            print(f"  {mode}: greedy agreement {100 * e['greedy_agreement']:.1f}% ({e['identical_runs']}/"
                  f"{entry['num_prompts']} runs identical, {e['mean_tokens_before_first_difference']:.1f} tokens "
                  f"before the first difference); perplexity {e['perplexity']:.3f} "
                  f"({100 * e['perplexity_change']:+.2f}%)")
    if not args.no_tts:
        from tts_realtime import build_checkpoint

        path = args.tts_model or str(
            build_checkpoint(args.tts_size, Path(args.cache_dir) / f"qwen3-tts-{args.tts_size}")
        )
        entry = results["tts_talker"] = tts_talker(path, args.modes, args.tts_frames)
        print(f"{entry['model']} ({entry['num_layers']} layers, hidden {entry['hidden_size']}), "
              f"{entry['frames']} teacher-forced frames (text projection in int8: rows' relative error "
              f"{entry['text_projection_int8_relative_error']:.4f}):")
        for mode in args.modes:
            e = entry[mode]
            print(f"  {mode}: logits relative error {e['logits_relative_error']:.4f}, codebook-0 top-1 agreement "
                  f"{100 * e['codebook0_top1_agreement']:.1f}%")
        entry = results["tts_code_predictor"] = tts_code_predictor(path, args.modes, args.tts_frames)
        print(f"{entry['model']} ({entry['num_layers']} layers), {entry['frames']} teacher-forced frames, "
              f"{entry['codebooks']} residual codebooks:")
        for mode in args.modes:
            for name, e in entry[mode].items():
                print(f"  {mode} layers, {name.replace('_', ' ')}: logits relative error "
                      f"{e['logits_relative_error']:.4f}, top-1 agreement {100 * e['top1_agreement']:.1f}%")
        entry = results["tts_codec"] = tts_codec(path, args.tts_frames)
        print(f"{entry['model']}, {entry['frames']} random frames (fp32 audio RMS {entry['fp32_rms']:.3f}): conv stack "
              f"in bf16 against fp32, SNR {entry['bf16_one_shot_snr_db']:.1f} dB one-shot, "
              f"{entry['bf16_streamed_snr_db']:.1f} dB streamed in chunks of {entry['chunk_frames']} frames")
    results["total_s"] = time.perf_counter() - started
    print(f"total {results['total_s']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
