"""Qwen3-Omni-30B-A3B's thinker and talker decoders at the released widths, quantized, on this CPU: per-layer costs
of a decode step, a batch of rows, a speculative verify and a prefill, next to their floors, and what they add up to
over the released depths.

The whole model does not fit this box in float, so this builds `--layers` decoder layers of each (random weights in
the released shapes: thinker 32 / 4 heads × 128, 128 experts of 2 × 768 × 2048 top-8; talker 16 / 2 heads × 128,
128 experts of 2 × 384 × 1024 top-6 and a 768-wide gated shared expert; `THINKER` and `TALKER` below, from the
released config.json), one layer at a time in bf16, each quantized as soon as it is packed (the engine's
`PackedDecoder.from_layers(quantize=)`), and times the packed decoder as the engine runs it:

- a decode step of one row after a `--prompt`-token prompt, and of `--batch` rows;
- a verify of k + 1 = 2, 3, 4 positions of one row (a speculative step with k drafts), against the plain step;
- a prefill of the prompt;
- the thinker's LM head (152064 × 2048, kept in bf16 as the engine keeps it: not quantized) as one `torch.mv`.

Per layer: median ms, and for the one-row step its floor, the bytes the step reads (the layer's attention and
shared-expert weights, the router, the picked experts' weights and scales, the KV rows) ÷ the read bandwidth
measured in the same run. The totals scale the per-layer figures to the released depths (48 thinker, 20 talker
layers) and add the LM head: the thinker's tokens a second at batch 1, extrapolated from `--layers` layers (experts
picked by random routers, so a verify's rows pick more distinct experts than a trained model's consecutive
tokens would). Peak RSS of the process is reported too. Writes JSON.

    python benchmarks/omni_realsize.py [--layers 4] [--quantize w4a8] [--threads 2] [--out r.json]
    python benchmarks/omni_realsize.py --quick      # reduced widths: a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeTalkerModel,
    Qwen3OmniMoeThinkerTextModel,
)
from tts_realtime import machine_floors  # noqa: E402

from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward  # noqa: E402
from omnimtp.runtime.ops import QUANTIZE_MODES  # noqa: E402

_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [24, 20, 20], "interleaved": True}
# Qwen3-Omni-30B-A3B-Instruct's config.json: thinker_config.text_config and talker_config.text_config
THINKER = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               intermediate_size=768, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
               shared_expert_intermediate_size=0, norm_topk_prob=True, vocab_size=152064, rms_norm_eps=1e-6,
               max_position_embeddings=65536, mlp_only_layers=[], decoder_sparse_step=1)
TALKER = dict(hidden_size=1024, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
              intermediate_size=2048, moe_intermediate_size=384, num_experts=128, num_experts_per_tok=6,
              shared_expert_intermediate_size=768, norm_topk_prob=True, vocab_size=3072, rms_norm_eps=1e-6,
              max_position_embeddings=65536, mlp_only_layers=[], decoder_sparse_step=1)
QUICK = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=128,
             moe_intermediate_size=128, num_experts=16, vocab_size=4096)


def build_decoder(name: str, fields: dict, num_layers: int, quantize: str, seed: int) -> PackedDecoder:
    """`num_layers` layers of the decoder in bf16 random weights (std 0.02), each quantized as packed into an fp32
    decoder (activations, norms and the KV cache in fp32, as the CPU kernels run them)."""
    config_class, model_class = ((Qwen3OmniMoeTextConfig, Qwen3OmniMoeThinkerTextModel) if name == "thinker"
                                 else (Qwen3OmniMoeTalkerTextConfig, Qwen3OmniMoeTalkerModel))
    config = config_class(**{**fields, "num_hidden_layers": num_layers}, rope_parameters=dict(_ROPE))
    with torch.device("meta"):
        module = model_class(config)
    module = module.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        for norm_name, param in module.named_parameters():
            if "norm" in norm_name:
                param.fill_(1.0)
    module.rotary_emb = type(module.rotary_emb)(config)  # its buffers computed on the CPU, not left empty
    return PackedDecoder.from_module(module, dtype=torch.float32, quantize=quantize)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def step_fn(decoder: PackedDecoder, prompt: torch.Tensor, rows: int, positions: int):
    """A function that runs one forward of `positions` new positions for `rows` rows after the prompt (each call
    on a fresh copy of the prompt's cache, so every call sees the same lengths)."""
    hidden = decoder.hidden_size
    cache = KVCache(decoder, rows, prompt.shape[1] + positions + 1)
    decoder_forward(decoder, cache, prompt.expand(rows, -1, -1).contiguous(), list(range(rows)))
    saved = cache.snapshot()
    generator = torch.Generator().manual_seed(rows * 10 + positions)
    embeds = [(torch.randn(rows, positions, hidden, generator=generator) * 0.02).to(decoder.dtype) for _ in range(8)]
    state = {"i": 0}

    def run():
        state["i"] += 1
        decoder_forward(decoder, cache, embeds[state["i"] % len(embeds)], list(range(rows)))
        cache.restore(saved)

    return run


def layer_bytes(decoder: PackedDecoder, prompt_len: int) -> int:
    """Bytes one layer's one-row step reads: attention (and shared experts), router, top-k experts, KV rows."""
    layer, quantized = decoder.layers[0], decoder.quantized_layers[0]
    total = sum(t.numel() * t.element_size() for q in quantized if q is not None for t in (q.packed, q.scales))
    total += layer.router_row_kernel.numel() * 4
    gate_up, down = layer.quantized_experts
    per_expert = sum(t[0].numel() * t.element_size() for q in (gate_up, down) for t in (q.packed, q.scales))
    total += layer.router.top_k * per_expert
    total += 2 * decoder.num_kv_heads * decoder.head_dim * prompt_len * decoder.dtype.itemsize  # keys, values
    return total


def bench(name: str, fields: dict, args, read_gb_s: float) -> dict:
    started = time.perf_counter()
    decoder = build_decoder(name, fields, args.layers, args.quantize, seed=len(name))
    built_s = time.perf_counter() - started
    layers = decoder.num_layers
    prompt = torch.randn(1, args.prompt, decoder.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.02
    result = {"decoder": name, "layers_built": layers, "released_layers": fields["num_hidden_layers"],
              "build_s": built_s, "ms_per_layer": {}}
    per_layer = result["ms_per_layer"]
    per_layer["step_1_row"] = 1e3 * timed(step_fn(decoder, prompt, 1, 1), args.repeats) / layers
    per_layer[f"step_{args.batch}_rows"] = 1e3 * timed(step_fn(decoder, prompt, args.batch, 1), args.repeats) / layers
    for k in (1, 2, 3):
        per_layer[f"verify_k{k}"] = 1e3 * timed(step_fn(decoder, prompt, 1, k + 1), args.repeats) / layers
    cache = KVCache(decoder, 1, args.prompt + 1)
    empty = cache.snapshot()
    per_layer[f"prefill_{args.prompt}"] = 1e3 * timed(
        lambda: (decoder_forward(decoder, cache, prompt, [0]), cache.restore(empty)), max(3, args.repeats // 4)
    ) / layers
    floor_ms = 1e3 * layer_bytes(decoder, args.prompt) / (read_gb_s * 1e9)
    result["floor_ms_per_layer_step_1_row"] = floor_ms
    released = fields["num_hidden_layers"]
    result["step_1_row_ms_released_depth"] = per_layer["step_1_row"] * released
    if name == "thinker":
        lm_head = torch.randn(fields["vocab_size"], decoder.hidden_size, dtype=torch.bfloat16) * 0.02
        row = torch.randn(decoder.hidden_size, dtype=torch.bfloat16)
        lm_ms = 1e3 * timed(lambda: torch.mv(lm_head, row), args.repeats)
        result["lm_head_bf16_ms"] = lm_ms
        result["lm_head_floor_ms"] = 1e3 * lm_head.numel() * 2 / (read_gb_s * 1e9)
        token_ms = result["step_1_row_ms_released_depth"] + lm_ms
        result["tokens_per_s_batch_1"] = 1e3 / token_ms
        result["tokens_per_s_floor"] = 1e3 / (floor_ms * released + result["lm_head_floor_ms"])
        batch_ms = per_layer[f"step_{args.batch}_rows"] * released + lm_ms  # (the LM head's rows: one read)
        result[f"tokens_per_s_batch_{args.batch}"] = args.batch * 1e3 / batch_ms
    print(f"{name}: {layers} of {released} layers built in {built_s:.0f} s; per layer: " + ", ".join(
        f"{key} {ms:.2f} ms" for key, ms in per_layer.items()) + f"; one-row floor {floor_ms:.2f} ms", flush=True)
    if name == "thinker":
        print(f"  thinker at 48 layers + LM head ({result['lm_head_bf16_ms']:.1f} ms, floor "
              f"{result['lm_head_floor_ms']:.1f}): {result['tokens_per_s_batch_1']:.1f} tokens/s at batch 1 "
              f"(floor {result['tokens_per_s_floor']:.1f}), {result[f'tokens_per_s_batch_{args.batch}']:.1f} at "
              f"batch {args.batch}", flush=True)
    else:
        print(f"  talker at {released} layers: {result['step_1_row_ms_released_depth']:.1f} ms a frame's step "
              f"(floor {floor_ms * released:.1f})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="layers built of each decoder (measured per layer)")
    parser.add_argument("--quantize", default="w4a8", choices=QUANTIZE_MODES)
    parser.add_argument("--prompt", type=int, default=64, help="prompt positions before the timed steps")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="reduced widths, 2 layers, 3 repeats")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    thinker, talker = THINKER, TALKER
    if args.quick:
        thinker, talker = {**THINKER, **QUICK}, {**TALKER, **QUICK}
        args.layers, args.repeats, args.prompt = 2, 3, 16
    torch.set_num_threads(args.threads)
    floors = machine_floors(args.threads, args.quick)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.quantize}: read {floors['read_gb_s']:.1f} GB/s",
          flush=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
               "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(), "quantize": args.quantize,
               "prompt": args.prompt, "batch": args.batch, "floors": floors}
    with torch.inference_mode():
        results["thinker"] = bench("thinker", thinker, args, floors["read_gb_s"])
        results["talker"] = bench("talker", talker, args, floors["read_gb_s"])
    results["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"peak RSS {results['peak_rss_gb']:.2f} GB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
