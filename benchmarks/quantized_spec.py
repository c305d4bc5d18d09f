"""MTP speculative decoding on a quantized target: what each mode costs against the float target.

On the shipped demo LM (`omnimtp/data/demo_lm`, a trained Glm4Moe and its trained MTP head), over its held-out
prompts (stdlib code neither saw; each cut to its first `--prefix-tokens` tokens), per mode (the target's layers
int8 / int4 / w4a8 and its LM head int8, `speculative_generate(quantize=)`; the head drafts in float):

- greedy agreement with the float target: of `--new-tokens` greedy tokens (`plain_generate`), the share of
  positions where both pick the same token, the runs that are identical and the mean number of tokens before the
  first difference;
- acceptance: the mean acceptance length τ and the acceptance rate at k = `-k`, next to the float target's (the
  head was trained on the float target's hidden states and drafts in float);
- whether greedy speculative output equals greedy plain output on the same quantized target (it must).

    python benchmarks/quantized_spec.py [--quick] [--threads 2] [--out q.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from omnimtp import plain_generate, speculative_generate
from omnimtp.mtp.demo import demo_heldout_prompts, load_demo_model
from omnimtp.runtime.ops import QUANTIZE_MODES


def measure(num_prompts: int, prefix: int, num_new: int, k: int) -> dict:
    target, head, tokenizer = load_demo_model("lm")
    prompts = [torch.tensor([tokenizer.encode(text)[:prefix]]) for text in demo_heldout_prompts("lm")[:num_prompts]]
    result = {"model": "demo LM (Glm4Moe) + its MTP head", "num_prompts": len(prompts), "prefix_tokens": prefix,
              "new_tokens": num_new, "num_draft_tokens": k}
    runs = {}
    for mode in (None, *QUANTIZE_MODES):
        plain, accepted, drafted, row_steps, lossless = [], 0, 0, 0, True
        for prompt in prompts:
            tokens = plain_generate(target, prompt, max_new_tokens=num_new, eos_token_id=-1, quantize=mode)
            out = speculative_generate(target, head, prompt, max_new_tokens=num_new, num_draft_tokens=k,
                                       eos_token_id=-1, quantize=mode)
            lossless &= torch.equal(out.sequences, tokens)
            plain.append(tokens[0, prompt.shape[1]:].tolist())
            accepted, drafted = accepted + out.stats.num_accepted, drafted + out.stats.num_drafted
            row_steps += out.stats.num_row_steps
        runs[mode] = plain
        entry = {"mean_acceptance_length": 1 + accepted / row_steps, "acceptance_rate": accepted / drafted,
                 "speculative_equals_plain": lossless}
        if mode is not None:
            prefixes = [next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), num_new)
                        for ref, got in zip(runs[None], plain, strict=True)]
            same = sum(a == b for ref, got in zip(runs[None], plain, strict=True)
                       for a, b in zip(ref, got, strict=True))
            entry.update(greedy_agreement=same / (num_new * len(prompts)),
                         identical_runs=sum(p == num_new for p in prefixes),
                         mean_tokens_before_first_difference=sum(prefixes) / len(prefixes))
        result[mode or "fp32"] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts, 24 new tokens")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_prompts, num_new = (4, 24) if args.quick else (args.prompts, args.new_tokens)
    result = measure(num_prompts, args.prefix_tokens, num_new, args.k)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
