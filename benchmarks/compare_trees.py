"""Time one benchmark script in this checkout and in a previous one, side by side in one run.

The previous tree is a checkout you make yourself, e.g. a worktree of the commit before a refactor:

    git worktree add /tmp/prev HEAD~1
    python benchmarks/compare_trees.py --previous-tree /tmp/prev --repeats 3 -- benchmarks/e2e.py --quick
    git worktree remove /tmp/prev

The current tree is the checkout holding this script unless `--current-tree DIR` names another.
Everything after `--` is the benchmark: a script path relative to the repository root, then its
arguments. Each tree runs its own copy of the script in a fresh subprocess with `PYTHONPATH=<tree>`
and `cwd=<tree>`, so `import omnimtp` resolves to that tree and not to the editable install. The runs
are interleaved (current, previous, current, previous, ...) so that a change in machine load hits both
trees alike. `OMP_NUM_THREADS` is `--threads`, or the value of the benchmark's own `--threads N` when
the benchmark arguments pass one. Each run writes its JSON through the benchmark's `--out PATH`
(appended last, so it wins over any `--out` given to the benchmark).

Every numeric leaf of a run's JSON gets a dotted key path (list items by index: `results.0.ours_total_s`);
per tree the median over the repeats is taken. The printed table shows the timing leaves, found by the
words of the path (split at `.` and `_`):
- rate, higher is better: a word `speedup` or `throughput`, or the words `per` `s` in a row
  (`tokens_per_s`, `requests_per_s`, `speedup_vs_hf.re_prefill`);
- time, lower is better: otherwise a word `s`, `ms`, `time`, `latency` or `rtf`
  (`ours_total_s`, `ms_per_frame.runner_eager`, `draft_time_s`, `ours_rtf`).
Other leaves (counts, sizes, flags, load averages) are not shown; all leaves are written to `--out`
(default `benchmarks/results/compare_<script name>.json`) with the trees, their commits (and whether
they had uncommitted changes), the date, the command, the raw leaves of every run in run order, and
the medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CURRENT_TREE = Path(__file__).resolve().parent.parent
RATE_WORDS = {"speedup", "throughput"}
TIME_WORDS = {"s", "ms", "time", "latency", "rtf"}
STDERR_TAIL_LINES = 30


class UsageError(Exception):
    """A bad command line; exits 2 with its message."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """Our options come before `--`, the benchmark script and its arguments after it."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="compare_trees.py --previous-tree DIR [--current-tree DIR] [--repeats N] [--threads N] [--out PATH]"
        " -- SCRIPT [ARGS ...]",
    )
    parser.add_argument("--previous-tree", required=True, metavar="DIR", help="checkout to compare against")
    parser.add_argument("--current-tree", type=Path, default=CURRENT_TREE, metavar="DIR",
                        help="checkout to compare (default: the one holding this script)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tree, interleaved (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS unless the benchmark passes --threads")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/compare_<script>.json")
    if "--" not in argv:
        parser.error("put the benchmark after `--`, e.g. `-- benchmarks/e2e.py --quick`")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    if split + 1 == len(argv):
        parser.error("no benchmark script after `--`")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args, argv[split + 1], argv[split + 2 :]


def check_tree(tree: Path, script: str, option: str) -> None:
    if not tree.is_dir():
        raise UsageError(f"{option} {tree}: not a directory")
    if not (tree / "omnimtp").is_dir():
        raise UsageError(f"{option} {tree}: has no omnimtp/ package (make one with `git worktree add {tree} <rev>`)")
    if not (tree / script).is_file():
        raise UsageError(f"{option} {tree}: has no {script}")


def benchmark_threads(script_args: list[str]) -> str | None:
    """The value of `--threads N` or `--threads=N` among the benchmark's arguments, else None."""
    for i, arg in enumerate(script_args):
        if arg == "--threads" and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return None


def git_state(tree: Path) -> dict:
    """The tree's commit and whether it has uncommitted changes (both None outside a git checkout)."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    status = subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, text=True)
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def run_once(tree: Path, script: str, script_args: list[str], num_threads: str, out_path: Path) -> dict:
    """One benchmark run in its own process, with `tree` as its omnimtp; returns the JSON it wrote."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=num_threads)
    command = [sys.executable, str(tree / script), *script_args, "--out", str(out_path)]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-STDERR_TAIL_LINES:])
        raise RuntimeError(f"{' '.join(command)} (cwd {tree}) exited with {done.returncode}; stderr tail:\n{tail}")
    return json.loads(out_path.read_text())


def flatten(value, prefix: str = "") -> dict[str, float]:
    """Numeric leaves by dotted path: {"a": [{"b_s": 1}], "ok": True} -> {"a.0.b_s": 1}; bools are not numbers here."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return {prefix: value}
    else:
        return {}
    leaves = {}
    for key, item in items:
        leaves.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def better(path: str) -> str | None:
    """'higher' for rate-like leaves, 'lower' for time-like ones, None for the rest (rule: module docstring)."""
    words = path.replace(".", "_").split("_")
    if RATE_WORDS.intersection(words) or any(a == "per" and b == "s" for a, b in zip(words, words[1:], strict=False)):
        return "higher"
    if TIME_WORDS.intersection(words):
        return "lower"
    return None


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    paths = sorted({path for leaves in runs for path in leaves})
    return {path: statistics.median(leaves[path] for leaves in runs if path in leaves) for path in paths}


def compare(previous: dict[str, float], current: dict[str, float]) -> list[dict]:
    """One row per leaf of either tree; ratio = current / previous (None where a side is missing or 0)."""
    rows = []
    for path in sorted(set(previous) | set(current)):
        prev, cur = previous.get(path), current.get(path)
        ratio = cur / prev if prev and cur is not None else None
        rows.append({"metric": path, "previous": prev, "current": cur, "ratio": ratio, "better": better(path)})
    return rows


def format_table(rows: list[dict]) -> str:
    def number(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    shown = [row for row in rows if row["better"] is not None]
    if not shown:
        return "no timing leaves in the benchmark's JSON"
    width = max(len("metric"), *(len(row["metric"]) for row in shown))
    lines = [f"{'metric':<{width}}  {'previous':>10}  {'current':>10}  {'cur/prev':>8}  better"]
    for row in shown:
        lines.append(f"{row['metric']:<{width}}  {number(row['previous']):>10}  {number(row['current']):>10}  "
                     f"{number(row['ratio']):>8}  {row['better']}")
    return "\n".join(lines)


def run_interleaved(
    trees: dict[str, Path], script: str, script_args: list[str], repeats: int, num_threads: str
) -> list[dict]:
    """`repeats` rounds of one run per tree, in the order of `trees`; the run records in run order."""
    records = []
    with tempfile.TemporaryDirectory(prefix="compare_trees_") as tmp:
        for repeat in range(repeats):
            for name, tree in trees.items():
                out_path = Path(tmp) / f"{name}_{repeat}.json"
                print(f"[{name} {repeat + 1}/{repeats}] {tree}", flush=True)
                leaves = flatten(run_once(tree, script, script_args, num_threads, out_path))
                records.append({"tree": name, "repeat": repeat, "leaves": leaves})
    return records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, script, script_args = parse_args(argv)
    current_tree, previous_tree = args.current_tree.resolve(), Path(args.previous_tree).resolve()
    try:
        if Path(script).is_absolute():
            raise UsageError(f"benchmark {script}: give the script relative to the repository root")
        check_tree(current_tree, script, "--current-tree")
        check_tree(previous_tree, script, "--previous-tree")
    except UsageError as error:
        print(f"compare_trees: {error}", file=sys.stderr)
        return 2
    trees = {"current": current_tree, "previous": previous_tree}
    num_threads = benchmark_threads(script_args) or str(args.threads)
    try:
        records = run_interleaved(trees, script, script_args, args.repeats, num_threads)
    except RuntimeError as error:
        print(f"compare_trees: benchmark failed: {error}", file=sys.stderr)
        return 1
    tree_medians = {name: medians([r["leaves"] for r in records if r["tree"] == name]) for name in trees}
    rows = compare(tree_medians["previous"], tree_medians["current"])
    print(format_table(rows))
    out = args.out or current_tree / "benchmarks" / "results" / f"compare_{Path(script).stem}.json"
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": [sys.executable, str(Path(__file__).resolve()), *argv],
        "benchmark": [script, *script_args], "repeats": args.repeats, "omp_num_threads": num_threads,
        "trees": {name: {"path": str(tree), **git_state(tree)} for name, tree in trees.items()},
        "runs": records, "medians": tree_medians, "comparison": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
