"""Speculation against our own plain loop on the same forward, held-out prompts, interleaved, at batch 1 (and
at every --batches size: B prompts decoded together, left-padded for the demo LMs, cycling through the prompts):

- demo LM (`omnimtp/data/demo_lm`, Glm4Moe): `speculative_generate` vs `plain_generate` (packed target, row kernel);
- GLM-5 demo (`omnimtp/data/demo_glm5`, GlmMoeDsa: MLA with the DSA indexer): the same two loops on transformers'
  forward (the packed target does not run MLA);
- demo omni thinker (`omnimtp/data/demo_omni`): speculative `ThinkerRun` vs the plain `ThinkerRun`;
each greedy (output checked equal to plain's) and sampled with Qwen3-Omni's thinker defaults (T 0.7, top-k 20,
top-p 0.8, seeded), at fixed k (--ks, default 3) and k = auto; plus the row kernel's verify cost (a (k+1)-row
forward over a one-row step) and, with --oracle, an oracle drafter at fixed acceptance rates on a random-weight
llama target (--oracle-hidden/--oracle-layers; the defaults are 1024 × 8 layers + a 32000-token vocabulary,
~190 M parameters) at batch 1, 4 and 16: achieved speed-up over plain_generate against the ideal τ / (1 + draft
cost), the drafter's cost being what the oracle's own work measures (about nothing), and k = auto beside k = 3
(its costs calibrated once per batch size: the k it picks per batch size is reported).

Each speculative method also reports what one of its steps costs over a plain step (`draft_over_plain_step`: the
drafts of a step that drafts; `verify_over_plain_step`, `step_over_plain_step`: per step, plain steps of "auto"
included), a plain step being the plain loop's time over its tokens.

For every repeat, prompt and method the runs go back to back, so load changes hit them alike; a ratio is the
median over repeats of same-repeat total-time ratios. Costs of "auto" are calibrated once (reported), in this
run: the on-disk cost cache is off (OMNIMTP_DRAFT_COST_CACHE=0) unless --cached-costs.

    python benchmarks/spec_speed.py --threads 1 --repeats 3 --num-prompts 8 --max-new-tokens 96
        --out benchmarks/results/spec_speed.json
    python benchmarks/spec_speed.py --oracle --only-oracle --threads 1 --repeats 3 --max-new-tokens 64
    python benchmarks/spec_speed.py --threads 1 --repeats 3 --batches 1 4 16 --oracle   # plain vs k = 3 vs auto
    python benchmarks/spec_speed.py --quick            # a small setting that checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp import SamplingParams, plain_generate, speculative_generate  # noqa: E402
from omnimtp.sampling import make_generators  # noqa: E402
from omnimtp.spec_decode.adaptive import DEFAULT_MAX_DRAFT_TOKENS  # noqa: E402
from omnimtp.spec_decode.generate import calibrate_draft_costs  # noqa: E402

SAMPLED = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)  # Qwen3-Omni's thinker defaults


DEMOS = {"lm": "demo LM", "glm5": "GLM-5 demo", "omni": "demo omni thinker"}  # --demos → the tables' names


def interleaved(methods: dict, num_prompts: int, repeats: int) -> dict:
    """methods: name → run(i) → (token ids, stats or None). → name → {seconds per repeat, outputs, stats}."""
    results = {name: {"seconds": [], "outputs": [], "stats": []} for name in methods}
    for repeat in range(repeats):
        totals = dict.fromkeys(methods, 0.0)
        for i in range(num_prompts):
            for name, run in methods.items():
                start = time.perf_counter()
                ids, stats = run(i)
                totals[name] += time.perf_counter() - start
                if repeat == 0:
                    results[name]["outputs"].append(ids)
                    results[name]["stats"].append(stats)
        for name in methods:
            results[name]["seconds"].append(totals[name])
    return results


def summarize(results: dict, baseline: str, check_equal: bool, baseline_tokens: int | None = None) -> dict:
    """Speed-ups over `baseline`, τ, the draft histogram and, with baseline_tokens (the baseline's forwards in
    one repeat: a batch's one per token of its longest row), a step's drafting and verifying time over a plain
    step."""
    base = results[baseline]
    plain_step_s = min(base["seconds"]) / baseline_tokens if baseline_tokens else None
    out = {}
    for name, r in results.items():
        entry = {"seconds_per_repeat": r["seconds"]}
        if name != baseline:
            entry["speedup"] = statistics.median(b / s for s, b in zip(r["seconds"], base["seconds"], strict=True))
            stats = [s for run in r["stats"] for s in (run if isinstance(run, list) else [run]) if s is not None]
            if stats:
                steps = sum(s.num_row_steps for s in stats)
                entry["tau"] = 1 + sum(s.num_accepted for s in stats) / steps
                histogram: dict[int, int] = {}
                for s in stats:
                    for k, n in s.draft_histogram.items():
                        histogram[k] = histogram.get(k, 0) + n
                entry["draft_histogram"] = dict(sorted(histogram.items()))
                entry["draft_costs"] = stats[0].draft_costs
                if plain_step_s:
                    num_steps = sum(s.num_steps for s in stats)
                    num_drafting = num_steps - histogram.get(0, 0)
                    entry["draft_over_plain_step"] = (
                        sum(s.draft_time_s for s in stats) / max(num_drafting, 1) / plain_step_s
                    )
                    entry["step_over_plain_step"] = (
                        sum(s.draft_time_s + s.verify_time_s for s in stats) / num_steps / plain_step_s
                    )
                    entry["verify_over_plain_step"] = sum(s.verify_time_s for s in stats) / num_steps / plain_step_s
            if check_equal:
                entry["matches_plain"] = all(_same(a, b) for a, b in zip(r["outputs"], base["outputs"], strict=True))
        out[name] = entry
    return out


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts → ids [B, P] left-padded with 0 and their attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :], mask[b, width - len(r) :] = r, 1
    return ids, mask


def groups(num_prompts: int, batch: int) -> list[list[int]]:
    """num_prompts runs of `batch` prompt indices, run i starting at prompt i and cycling."""
    return [[(i + j) % num_prompts for j in range(batch)] for i in range(num_prompts)]


def demo_lm(args, batch: int = 1, name: str = "lm") -> dict:
    """A shipped demo LM (`demo_model_dir(name)`: "lm" or "glm5") through both loops."""
    from transformers import AutoTokenizer

    from omnimtp.mtp.demo import demo_model_dir
    from omnimtp.mtp.load import load_target_and_head

    directory = demo_model_dir(name)
    target, head = load_target_and_head(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = json.loads((directory / "heldout_prompts.json").read_text())[: args.num_prompts]
    rows = [tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]
    prompts = [left_padded([rows[j] for j in group]) for group in groups(len(rows), batch)]
    n = args.max_new_tokens
    report = {}
    for label, sampling in (("greedy", None), ("sampled", SAMPLED)):
        def plain(i, sampling=sampling):
            ids, mask = prompts[i]
            return (
                plain_generate(target, ids, mask, max_new_tokens=n, sampling=sampling, seed=i, eos_token_id=-1),
                None,
            )

        def spec(k, sampling=sampling):
            def run(i):
                ids, mask = prompts[i]
                out = speculative_generate(target, head, ids, mask, max_new_tokens=n, num_draft_tokens=k,
                                           sampling=sampling, seed=i, eos_token_id=-1)
                return out.sequences, out.stats
            return run

        methods = {"plain": plain, **{f"k{k}": spec(k) for k in args.ks}, "auto": spec("auto")}
        for method in methods.values():
            method(0)  # warm-up; "auto" calibrates its costs here, once
        report[label] = summarize(interleaved(methods, len(prompts), args.repeats), "plain", sampling is None,
                                  n * len(prompts))  # plain forwards: one per token of a row
    return report


def demo_omni(args, batch: int = 1) -> dict:
    from omnimtp.mtp.demo import demo_omni_dir, demo_omni_prompts
    from omnimtp.mtp.head import MTPHead
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
    from omnimtp.thinker import ThinkerRun

    pipe = OmniPipeline.demo(thinker_mtp=None)
    head = MTPHead.from_pretrained(demo_omni_dir(), pipe.model.thinker).eval()
    prompts = [pipe.family.chat_ids([{"role": "user", "content": t}]) for t in demo_omni_prompts()[: args.num_prompts]]
    runs = groups(len(prompts), batch)
    report = {}
    for label, sampling in (("greedy", None), ("sampled", SAMPLED)):
        def runner(speculation, sampling=sampling):
            def run(i):
                thinker_run = ThinkerRun(
                    pipe.model.thinker, [prompts[j] for j in runs[i]], accept_hidden_layer=pipe.accept_hidden_layer,
                    eos_token_ids=pipe.eos_token_ids, max_new_tokens=args.max_new_tokens, decoder=pipe.thinker_decoder,
                    speculation=speculation, sampling=[sampling] * batch,
                    generators=make_generators([batch * i + j for j in range(batch)]),
                )
                with torch.inference_mode():
                    while not thinker_run.is_finished:
                        thinker_run.step()
                return thinker_run.output_ids, thinker_run.spec_stats
            return run

        methods = {"plain": runner(None), **{f"k{k}": runner(ThinkerSpeculation(head, k)) for k in args.ks},
                   "auto": runner(ThinkerSpeculation(head, "auto"))}
        for method in methods.values():
            method(0)
        results = interleaved(methods, len(prompts), args.repeats)
        plain_forwards = sum(max(len(ids) for ids in outputs) for outputs in results["plain"]["outputs"])
        report[label] = summarize(results, "plain", sampling is None, plain_forwards)
    return report


def verify_cost(args) -> dict:
    """Median ms of a one-row step and of (k+1)-row verify forwards on the demo LM's packed target."""
    from omnimtp.mtp.demo import demo_model_dir
    from omnimtp.mtp.load import load_target_and_head
    from omnimtp.runtime.kernels import small_batch_linear
    from omnimtp.runtime.kv_cache import KVCache
    from omnimtp.spec_decode.packed_target import packed_forward, packed_logits, packed_target

    target, _ = load_target_and_head(demo_model_dir())
    packed = packed_target(target)
    result = {"row_kernel": small_batch_linear.isa() if packed.row_kernel is not None else None}
    with torch.inference_mode():
        cache = KVCache(packed, 1, capacity=256)
        packed_forward(packed, cache, torch.arange(3, 103)[None], torch.arange(100)[None])
        length = cache.length
        for rows in (1, 2, 4, 5):
            ids, positions = torch.full((1, rows), 7), torch.arange(length, length + rows)[None]
            times = []
            for _ in range(30):
                start = time.perf_counter()
                packed_logits(packed, packed_forward(packed, cache, ids, positions)).argmax(-1)
                times.append(time.perf_counter() - start)
                cache.crop(-rows)
            result[f"rows{rows}_ms"] = 1e3 * statistics.median(times)
    result["verify_k3_over_plain_step"] = result["rows4_ms"] / result["rows1_ms"]
    return result


class OracleDrafter:
    """Drafts the target's own greedy continuation (precomputed), each draft right with probability
    `acceptance` (a fixed per-row stream of coin flips) and otherwise a wrong token: greedy verification then
    accepts a draft with that probability, given the ones before it were accepted."""

    def __init__(self, reference: torch.Tensor, prompt_len: int, acceptance: float, vocab: int):
        self.batch_reference, self.prompt_len, self.acceptance, self.vocab = reference, prompt_len, acceptance, vocab
        self.reset()

    def reset(self):
        self.coins = torch.Generator().manual_seed(0)
        self.reference = self.batch_reference

    def keep_rows(self, rows):  # the batch's finished rows leave: each row keeps its own continuation
        self.reference = self.reference[rows]

    def propose(self, block, num_draft_tokens, sampling, generators):
        rows = torch.arange(block.input_ids.shape[0])
        newest = block.position_ids[rows, block.last_index] + 1  # [B] position of the newest token
        index = (newest[:, None] + 1 + torch.arange(num_draft_tokens)).clamp(max=self.reference.shape[1] - 1)
        right = self.reference.gather(1, index)  # [B, k]
        hit = torch.rand(right.shape, generator=self.coins) < self.acceptance
        drafts = torch.where(hit, right, (right + 1) % self.vocab)
        return drafts, torch.nn.functional.one_hot(drafts, self.vocab).float()


def oracle(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.oracle_hidden, intermediate_size=4 * args.oracle_hidden, num_hidden_layers=args.oracle_layers,
        num_attention_heads=args.oracle_hidden // 64, num_key_value_heads=args.oracle_hidden // 128,
        vocab_size=args.oracle_vocab, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    num_params = sum(p.numel() for p in target.parameters())
    n, k = args.max_new_tokens, 3
    report = {"num_parameters": num_params, "k": k, "runs": []}
    for batch in args.oracle_batches:
        prompt = torch.randint(3, config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(batch))
        reference = plain_generate(target, prompt, max_new_tokens=n + DEFAULT_MAX_DRAFT_TOKENS + 2, eos_token_id=-1)
        costs = None  # "auto": this batch size's costs, measured once (with the first drafter) and reused
        for acceptance in (0.5, 0.7, 0.9):
            drafter = OracleDrafter(reference, prompt.shape[1], acceptance, config.vocab_size)
            if costs is None:
                costs = calibrate_draft_costs(target, drafter, batch_size=batch)
            methods = {
                "plain": lambda i, prompt=prompt: (
                    plain_generate(target, prompt, max_new_tokens=n, eos_token_id=-1), None
                ),
                "oracle": lambda i, drafter=drafter, prompt=prompt: (lambda out: (out.sequences, out.stats))(
                    speculative_generate(target, drafter, prompt, max_new_tokens=n, num_draft_tokens=k, eos_token_id=-1)
                ),
                "auto": lambda i, drafter=drafter, prompt=prompt, costs=costs: (
                    lambda out: (out.sequences, out.stats)
                )(speculative_generate(target, drafter, prompt, max_new_tokens=n, num_draft_tokens="auto",
                                       draft_costs=costs, eos_token_id=-1)),
            }
            for run in methods.values():
                run(0)
            results = interleaved(methods, 1, args.repeats)
            summaries = summarize(results, "plain", True)
            summary, auto = summaries["oracle"], summaries["auto"]
            stats = results["oracle"]["stats"][0]
            draft_cost = stats.draft_time_s / max(stats.verify_time_s, 1e-9)  # drafting relative to verifying
            ideal = summary["tau"] / (1 + draft_cost)
            # plain_generate: one forward per token (+ the prefill)
            plain_step_s = min(results["plain"]["seconds"]) / n
            entry = {"batch": batch, "acceptance": acceptance, "tau": summary["tau"], "speedup": summary["speedup"],
                     "ideal": ideal, "achieved_over_ideal": summary["speedup"] / ideal, "draft_cost": draft_cost,
                     "verify_over_plain_step": stats.verify_time_s / max(stats.num_steps, 1) / plain_step_s,
                     "matches_plain": summary["matches_plain"] and auto["matches_plain"],
                     "auto_speedup": auto["speedup"], "auto_draft_histogram": auto["draft_histogram"],
                     "auto_draft_costs": costs.step}
            report["runs"].append(entry)
            print(f"oracle batch {batch} acceptance {acceptance}: τ {entry['tau']:.2f} "
                  f"speed-up {entry['speedup']:.2f}x ideal {ideal:.2f}x ({entry['achieved_over_ideal']:.2f} of it) "
                  f"verify / plain step {entry['verify_over_plain_step']:.2f}; auto {auto['speedup']:.2f}x "
                  f"steps per k {auto['draft_histogram']}; match {entry['matches_plain']}")
    return report


def print_table(name: str, report: dict) -> None:
    for label, rows in report.items():
        print(f"{name} {label}:")
        for method, e in rows.items():
            if method == "plain":
                continue
            extra = f" steps per k {e['draft_histogram']}" if "draft_histogram" in e else ""
            match = f" match {e['matches_plain']}" if "matches_plain" in e else ""
            costs = ""
            if "verify_over_plain_step" in e:
                costs = (f"  per step / plain step: draft {e['draft_over_plain_step']:.2f} verify "
                         f"{e['verify_over_plain_step']:.2f} all {e['step_over_plain_step']:.2f}")
            print(f"  {method:5} {e['speedup']:.2f}x plain  τ {e.get('tau', 1):.2f}{extra}{match}{costs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", type=int, nargs="+", default=[3])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="batch sizes of the demo runs")
    parser.add_argument("--demos", nargs="+", choices=DEMOS, default=list(DEMOS), help="the demo models to run")
    parser.add_argument("--oracle", action="store_true", help="also the oracle drafter on a random-weight target")
    parser.add_argument("--only-oracle", action="store_true")
    parser.add_argument("--oracle-hidden", type=int, default=1024)
    parser.add_argument("--oracle-layers", type=int, default=8)
    parser.add_argument("--oracle-vocab", type=int, default=32000)
    parser.add_argument("--oracle-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--quick", action="store_true", help="2 prompts, 24 tokens, 1 repeat, a 2-layer hidden-256 oracle"
    )
    parser.add_argument("--cached-costs", action="store_true",
                        help="let `auto` read step costs an earlier process measured (default: measure them now)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not args.cached_costs:
        os.environ["OMNIMTP_DRAFT_COST_CACHE"] = "0"
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.repeats = 2, 24, 1
        args.oracle_hidden, args.oracle_layers, args.oracle_vocab, args.oracle_batches = 256, 2, 2048, [1, 4]
    torch.set_num_threads(args.threads)
    report = {"args": vars(args), "torch": torch.__version__}
    if not args.only_oracle:
        report["verify_cost"] = verify_cost(args)
        print(f"verify cost (demo LM, row kernel {report['verify_cost']['row_kernel']}): k = 3 verify / plain step "
              f"{report['verify_cost']['verify_k3_over_plain_step']:.2f}")
        for batch in args.batches:
            suffix = "" if batch == 1 else f"_batch{batch}"
            for demo in args.demos:
                key = f"demo_{demo}{suffix}"
                report[key] = demo_omni(args, batch) if demo == "omni" else demo_lm(args, batch, demo)
                print_table(f"{DEMOS[demo]}, batch {batch}", report[key])
    if args.oracle or args.only_oracle:
        report["oracle"] = oracle(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
