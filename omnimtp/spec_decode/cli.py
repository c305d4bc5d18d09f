"""`omnimtp spec`: generate with a checkpoint's MTP layer; optionally compare with plain decoding."""

from __future__ import annotations

import json
import sys
import time

from omnimtp.argtypes import QUANTIZE_CHOICES, draft_tokens
from omnimtp.console import printable


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("spec", help="MTP speculative decoding with a checkpoint's NextN layer")
    parser.add_argument("--model", default=None,
                        help="checkpoint dir: target + MTP layer + tokenizer (default: the shipped demo model)")
    parser.add_argument("--prompt", required=True, help="the text the model continues")
    parser.add_argument("-k", "--num-draft-tokens", type=draft_tokens, default=3,
                        help="drafted tokens per step, or 'auto': 0..6 a step, as many as the acceptance so far pays "
                        "for")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                        "holding this probability (1 = all)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampled run (default: unseeded)")
    parser.add_argument("--compare", action="store_true",
                        help="also run plain decoding, ours on the same forward (plain_generate) and transformers' "
                        "generate, and report the speed-up over each")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cpu", help="where target and head run (cpu, cuda, cuda:N)")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="the target quantized on the CPU (its layers' linears int8, int4 or w4a8, its LM head "
                        "int8; the MTP head drafts in float): speculative output is then lossless relative to the "
                        "quantized target (default: the weights as they are; a quantized checkpoint: its mode)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from omnimtp.mtp.demo import demo_model_dir
    from omnimtp.mtp.load import load_target_and_head
    from omnimtp.runtime.device import resolve_device
    from omnimtp.sampling import SamplingParams
    from omnimtp.spec_decode.adaptive import acceptance_warning
    from omnimtp.spec_decode.generate import plain_generate, speculative_generate
    from omnimtp.spec_decode.packed_target import stored_mode

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    model_dir = args.model if args.model is not None else demo_model_dir()
    device = resolve_device(args.device, "--device")
    target, head = load_target_and_head(model_dir)
    target, head = target.to(device), head.to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    spec_kwargs = dict(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens, sampling=sampling,
                       seed=args.seed, quantize=args.quantize)
    # a quantized target (--quantize, or a quantized checkpoint) is compared with plain decoding on itself only:
    # transformers' generate runs the float model, or none at all
    is_quantized = args.quantize is not None or stored_mode(target) is not None
    if args.compare:  # warm-up (and, with -k auto, the one-time cost calibration) outside the timed runs
        speculative_generate(target, head, input_ids, **spec_kwargs)
        plain_generate(target, input_ids, max_new_tokens=2, quantize=args.quantize)
    out = speculative_generate(target, head, input_ids, **spec_kwargs)
    text = tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True)
    result = {"text": text, "quantize": args.quantize or stored_mode(target), **out.stats.to_dict()}
    if args.compare:
        start = time.perf_counter()
        ours = plain_generate(target, input_ids, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                              quantize=args.quantize)
        ours_time = time.perf_counter() - start
        result["plain_tokens_per_s"] = (ours.shape[1] - input_ids.shape[1]) / ours_time
        result["speedup"] = result["tokens_per_s"] / result["plain_tokens_per_s"]
    if args.compare and is_quantized:
        result["outputs_match"] = torch.equal(ours, out.sequences)
        result["plain_text"] = tokenizer.decode(ours[0, input_ids.shape[1]:], skip_special_tokens=True)
    elif args.compare:
        generate_kwargs = {"do_sample": False} if sampling.is_greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or 0,
            "top_p": sampling.top_p,
        }
        if args.seed is not None:
            torch.manual_seed(args.seed)
        start = time.perf_counter()
        with torch.no_grad():
            plain = target.generate(input_ids, max_new_tokens=args.max_new_tokens, **generate_kwargs)
        plain_time = time.perf_counter() - start
        result["generate_tokens_per_s"] = (plain.shape[1] - input_ids.shape[1]) / plain_time
        result["speedup_vs_generate"] = result["tokens_per_s"] / result["generate_tokens_per_s"]
        # Sampled runs draw different random numbers, so only greedy outputs are expected to match.
        result["outputs_match"] = torch.equal(plain, out.sequences) and torch.equal(ours, out.sequences)
        result["plain_text"] = tokenizer.decode(plain[0, input_ids.shape[1]:], skip_special_tokens=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(printable(text))
        k = (
            f"auto (steps per k {dict(sorted(out.stats.draft_histogram.items()))})" if out.stats.is_adaptive
            else args.num_draft_tokens
        )
        print(
            f"k {k}  tau {result['mean_acceptance_length']:.2f}  per-position "
            + " ".join(f"{a:.2f}" for a in result["acceptance_per_position"])
            + f"  {result['tokens_per_s']:.1f} tok/s"
        )
        if args.compare:
            versus_generate = "" if is_quantized else (
                f"transformers generate {result['generate_tokens_per_s']:.1f} tok/s: speedup "
                f"{result['speedup_vs_generate']:.2f}x  "
            )
            print(
                f"plain (ours, same forward) {result['plain_tokens_per_s']:.1f} tok/s: "
                f"speedup {result['speedup']:.2f}x  {versus_generate}outputs match: {result['outputs_match']}"
            )
    warning = acceptance_warning(out.stats)
    if warning is not None:
        print(warning, file=sys.stderr)
    return 0
