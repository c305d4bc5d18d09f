"""The seed's MTP acceptance ablation on the GLM-5 demo target: τ of speculative decoding, arm by arm.

    python benchmarks/mtp_ablation.py --model runs/demo_glm5/lm --work runs/demo_glm5/ablation \\
        [--train-only HEAD ...] [--steps 150] [--num-prompts 32] [--max-new-tokens 64] [--ks 3 5] \\
        [--install omnimtp/data/demo_glm5] [--out benchmarks/results/mtp_ablation.json]

Arms (the seed's table: baseline 4.56 → +IndexShare/KVShare 5.10 → +rejection sampling 5.29 → +TV 5.47):

    baseline             head trained with CE, IndexShare off; drafts taken by argmax (q one-hot), verified
                         by rejection sampling against p (lossless; vLLM's default drafting)
    +IndexShare          head trained and drafting with IndexShare (draft steps 2..k reuse step 1's DSA
                         selection, `index_share_for_mtp_iteration`); argmax drafts
    +rejection sampling  the +IndexShare head; drafts sampled from q, accepted with min(1, p/q)
    +TV loss             head trained with CE + TV (`--tv-weight`), IndexShare on, sampled drafts

KVShare is not an arm: see the README's speculative-decoding section.

Every head starts from the same seeded init and trains the same steps on the same batches (`train_mtp_head`
on the standard library's training files; its DSA indexer trained by its KL loss in every arm). τ is
measured by real decoding (`speculative_generate`, batch 1, EOS off, `--max-new-tokens`) on held-out prompts
(the checkpoint's `heldout_prompts.json`), greedy and temperature 1 (seed = prompt index), at each k:
τ of a prompt = 1 + accepted / verify steps, and the table gives the mean over prompts with a 95 % percentile
bootstrap interval over prompts (paired arms: the same prompts). Greedy outputs are checked against
transformers' `generate` (`greedy_matches_generate`). Under greedy decoding drafts are argmax in every arm,
so +rejection sampling equals +IndexShare there.

Heads are trained once and kept in --work (resumable); `--train-only` trains the named heads and exits
(run several such processes in parallel, then one without it). τ counts tokens per verify, not time, so a
busy machine does not change it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp import SamplingParams, speculative_generate  # noqa: E402
from omnimtp.mtp.head import MTPHead  # noqa: E402
from omnimtp.mtp.train import (  # noqa: E402
    CHECKPOINT_NAME,
    MTPTrainConfig,
    collect_text_files,
    encode_files,
    train_mtp_head,
)
from omnimtp.mtp.train_cli import copy_target_files, load_target  # noqa: E402
from omnimtp.spec_decode.proposer import ArgmaxDrafts, MTPProposer  # noqa: E402

SEED_TAU = {"baseline": 4.56, "+IndexShare": 5.10, "+rejection sampling": 5.29, "+TV loss": 5.47}


@dataclass(frozen=True)
class HeadRecipe:
    tv_weight: float
    index_share: bool


@dataclass(frozen=True)
class Arm:
    name: str
    head: str  # a key of HEADS
    argmax_drafts: bool


HEADS = {"ce": HeadRecipe(tv_weight=0.0, index_share=False), "ce_share": HeadRecipe(tv_weight=0.0, index_share=True),
         "cetv_share": HeadRecipe(tv_weight=6.0, index_share=True)}
ARMS = [Arm("baseline", "ce", True), Arm("+IndexShare", "ce_share", True),
        Arm("+rejection sampling", "ce_share", False), Arm("+TV loss", "cetv_share", False)]


def train_head(target, name: str, recipe: HeadRecipe, streams, work: Path, args) -> Path:
    """Train (or resume, or reuse) the head `name`; returns its directory (model-mtp.safetensors)."""
    out = work / name
    if (out / "model-mtp.safetensors").exists():
        return out
    torch.manual_seed(args.seed)
    head = MTPHead.from_config(target)
    head.index_share = recipe.index_share
    config = MTPTrainConfig(num_draft_tokens=args.train_k, steps=args.steps, batch_size=args.batch_size,
                            seq_len=args.seq_len, lr=args.lr, tv_weight=recipe.tv_weight, eval_every=25,
                            checkpoint_every=25, seed=args.seed)
    started = time.time()
    stop_after = None
    if args.stop_at is not None:  # the schedule of --steps cut at --stop-at (resumed runs count what is done)
        state_path = out / CHECKPOINT_NAME
        done = torch.load(state_path, map_location="cpu")["step"] if state_path.exists() else 0
        stop_after = max(1, args.stop_at - done)
    result = train_mtp_head(target, head, streams["train"], streams["heldout"], config, checkpoint_dir=out,
                            resume=True, progress=False, stop_after=stop_after)
    head.save_pretrained(out)
    log = {"recipe": recipe.__dict__, "config": config.__dict__,
           "evals": result.evals, "train_s": time.time() - started}
    (out / "mtp_train_log.json").write_text(json.dumps(log, indent=1, default=str))
    print(f"head {name}: trained to step {len(result.losses)} in {time.time() - started:.0f}s, "
          f"held-out teacher-forced tau {result.evals[-1]['tau_greedy']:.3f}", flush=True)
    return out


def bootstrap_interval(values: list[float], num_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean over `values`."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(num_resamples))
    return means[int(0.025 * num_resamples)], means[int(0.975 * num_resamples) - 1]


def prompt_taus(target, drafter, prompts: list[torch.Tensor], k: int, sampling, max_new_tokens: int):
    """Per-prompt τ and sequences of one drafter (batch 1, EOS off, seed = prompt index)."""
    taus, sequences = [], []
    for i, ids in enumerate(prompts):
        out = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, num_draft_tokens=k,
                                   sampling=sampling, seed=i, eos_token_id=-1)
        taus.append(out.stats.mean_acceptance_length)
        sequences.append(out.sequences)
    return taus, sequences


def _greedy_twin(arm: Arm) -> Arm | None:
    """The arm with the same head and argmax drafts, whose greedy runs are `arm`'s (None: `arm` is one)."""
    if arm.argmax_drafts:
        return None
    return next((other for other in ARMS if other.head == arm.head and other.argmax_drafts), None)


def evaluate(target, tokenizer, head_dirs: dict[str, Path], arms: list[Arm], args) -> list[dict]:
    """One row per (arm, k, mode): mean τ over the held-out prompts with its 95 % bootstrap interval."""
    texts = json.loads((args.model / "heldout_prompts.json").read_text())[: args.num_prompts]
    if len(texts) < args.num_prompts:
        raise ValueError(f"--num-prompts {args.num_prompts}: the checkpoint holds {len(texts)} held-out prompts")
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in texts]
    plain = None
    heads = {}
    for name in {arm.head for arm in arms}:
        heads[name] = MTPHead.from_pretrained(head_dirs[name], target).eval()
        heads[name].index_share = HEADS[name].index_share
    modes = {"greedy": SamplingParams.greedy(), "T=1": SamplingParams(temperature=1.0)}
    rows = []
    started = time.time()
    for arm in arms:
        for k in args.ks:
            for mode, sampling in modes.items():
                if mode == "greedy" and _greedy_twin(arm) is not None:
                    continue  # greedy drafts are argmax in every arm: the twin arm's greedy cell is this one's
                proposer = MTPProposer(heads[arm.head])
                drafter = ArgmaxDrafts(proposer) if arm.argmax_drafts else proposer
                taus, sequences = prompt_taus(target, drafter, prompts, k, sampling, args.max_new_tokens)
                low, high = bootstrap_interval(taus, seed=args.seed)
                row = {"arm": arm.name, "head": arm.head, "k": k, "mode": mode, "tau": sum(taus) / len(taus),
                       "ci95": [low, high], "per_prompt_tau": taus}
                if mode == "greedy":
                    if plain is None:
                        with torch.no_grad():
                            plain = [target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens,
                                                     eos_token_id=-1) for ids in prompts]
                    row["greedy_matches_generate"] = all(
                        torch.equal(a, b) for a, b in zip(sequences, plain, strict=True)
                    )
                rows.append(row)
                print(f"{arm.name:>20} k={k} {mode:>6}: tau {row['tau']:.3f} [{low:.3f}, {high:.3f}] "
                      f"({time.time() - started:.0f}s)", flush=True)

    return rows


def print_table(rows: list[dict], ks: list[int]) -> None:
    modes = ("greedy", "T=1")
    print(f"\n{'arm':>20} | " + " | ".join(f"k={k} {mode:>6}" for k in ks for mode in modes) + " | seed (GLM-5.2)")
    for arm in ARMS:
        cells = []
        for k in ks:
            for mode in modes:
                name = _greedy_twin(arm).name if mode == "greedy" and _greedy_twin(arm) else arm.name
                row = next((r for r in rows if r["arm"] == name and r["k"] == k and r["mode"] == mode), None)
                if row is None:
                    cells.append("-")
                    continue
                cells.append(f"{row['tau']:.2f} [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]")
        print(f"{arm.name:>20} | " + " | ".join(cells) + f" | {SEED_TAU[arm.name]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the GLM-5 target checkpoint dir")
    parser.add_argument("--work", type=Path, required=True, help="where the arms' heads are trained and kept")
    parser.add_argument("--train-only", nargs="+", choices=sorted(HEADS), default=None)
    parser.add_argument("--data", default=sysconfig.get_paths()["stdlib"])
    parser.add_argument("--heldout-every", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--stop-at", type=int, default=None, help="end the heads' training at this step")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--train-k", type=int, default=3, help="draft steps the heads are unrolled in training")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--arms", nargs="+", choices=[arm.name for arm in ARMS], default=[arm.name for arm in ARMS])
    parser.add_argument("--rows", nargs="+", default=None,
                        help="JSON files of earlier runs: print their rows' table (and --install) instead of decoding")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--install", type=Path, default=None,
                        help="write the target with the best head (greedy τ at the first k, among the heads "
                             "whose IndexShare matches the config) to this dir")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/mtp_ablation.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target = load_target(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    streams_path = args.work / "streams.pt"
    if not streams_path.exists():
        train_files, heldout_files = collect_text_files([args.data], args.heldout_every, suffixes=(".py",))
        torch.save({"train": encode_files(tokenizer, train_files), "heldout": encode_files(tokenizer, heldout_files)},
                   streams_path)
    streams = torch.load(streams_path)
    names = args.train_only or sorted(HEADS)
    head_dirs = {name: train_head(target, name, HEADS[name], streams, args.work, args) for name in names}
    if args.train_only:
        return

    if args.rows:  # the table of earlier runs (e.g. one process per arm)
        rows = [row for path in args.rows for row in json.loads(Path(path).read_text())["rows"]]
    else:
        rows = evaluate(target, tokenizer, head_dirs, [arm for arm in ARMS if arm.name in args.arms], args)
    print_table(rows, args.ks)
    first_k = args.ks[0]
    shipped_share = bool(target.config.index_share_for_mtp_iteration)  # the head drafts as the config says
    candidates = [name for name in HEADS if HEADS[name].index_share == shipped_share]
    greedy_tau = {r["head"]: r["tau"] for r in rows if r["k"] == first_k and r["mode"] == "greedy"}
    best = max((name for name in candidates if name in greedy_tau), key=greedy_tau.get, default=None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "args": {k: str(v) for k, v in vars(args).items()},
                                    "seed_tau": SEED_TAU, "best_head": best, "rows": rows}, indent=1))
    print(f"best head (greedy tau at k={first_k}): {best}; wrote {args.out}")
    if args.install is not None and best is not None:
        copy_target_files(args.model, args.install)
        MTPHead.from_pretrained(head_dirs[best], target).save_pretrained(args.install)
        log = head_dirs[best] / "mtp_train_log.json"
        if log.exists():
            (args.install / "mtp_train_log.json").write_text(log.read_text())
        print(f"installed the target with head {best} in {args.install}")


if __name__ == "__main__":
    main()
