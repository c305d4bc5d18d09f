"""benchmarks/compare_trees.py on two fake checkouts whose `omnimtp` differ only in a SPEED constant."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_trees.py"

FAKE_BENCHMARK = """
import argparse, json, os
import omnimtp

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--log", required=True)
parser.add_argument("--threads", type=int)
args = parser.parse_args()
with open(args.log, "a") as f:
    f.write(f"{omnimtp.SPEED}\\n")
with open(args.out, "w") as f:
    json.dump({"a_s": omnimtp.SPEED, "items_per_s": 1 / omnimtp.SPEED, "count": 7,
               "omp": int(os.environ["OMP_NUM_THREADS"])}, f)
"""


def load_compare_trees():
    spec = importlib.util.spec_from_file_location("compare_trees", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_tree(path: Path, speed: float) -> Path:
    (path / "omnimtp").mkdir(parents=True)
    (path / "omnimtp" / "__init__.py").write_text(f"SPEED = {speed}\n")
    (path / "bench.py").write_text(FAKE_BENCHMARK)
    broken = "import sys\nprint('no good: the model is missing', file=sys.stderr)\nsys.exit(3)\n"
    (path / "broken.py").write_text(broken)
    return path


def test_compare_trees_runs_both_trees_interleaved_and_reports_median_ratios(tmp_path, capsys):
    compare_trees = load_compare_trees()
    current, previous = fake_tree(tmp_path / "cur", 2.0), fake_tree(tmp_path / "prev", 4.0)
    log, out = tmp_path / "order.log", tmp_path / "compare.json"
    argv = ["--current-tree", str(current), "--previous-tree", str(previous), "--repeats", "2", "--out", str(out),
            "--", "bench.py", "--log", str(log), "--threads", "3"]
    assert compare_trees.main(argv) == 0

    assert log.read_text().split() == ["2.0", "4.0", "2.0", "4.0"]
    report = json.loads(out.read_text())
    assert [(run["tree"], run["repeat"]) for run in report["runs"]] == [
        ("current", 0), ("previous", 0), ("current", 1), ("previous", 1)]
    assert report["omp_num_threads"] == "3" and report["medians"]["current"]["omp"] == 3
    rows = {row["metric"]: row for row in report["comparison"]}
    assert rows["a_s"] == {"metric": "a_s", "previous": 4.0, "current": 2.0, "ratio": 0.5, "better": "lower"}
    assert rows["items_per_s"]["ratio"] == pytest.approx(2.0) and rows["items_per_s"]["better"] == "higher"
    assert rows["count"]["better"] is None

    table = capsys.readouterr().out
    assert any(line.split() == ["a_s", "4", "2", "0.5", "lower"] for line in table.splitlines())
    assert any(line.split() == ["items_per_s", "0.25", "0.5", "2", "higher"] for line in table.splitlines())
    assert not any(line.startswith("count") for line in table.splitlines())


def test_a_previous_tree_without_omnimtp_exits_2_naming_the_option(tmp_path, capsys):
    compare_trees = load_compare_trees()
    current = fake_tree(tmp_path / "cur", 2.0)
    for bad in [tmp_path / "missing", tmp_path]:
        argv = ["--current-tree", str(current), "--previous-tree", str(bad), "--", "bench.py"]
        assert compare_trees.main(argv) == 2
        assert "--previous-tree" in capsys.readouterr().err


def test_a_failing_benchmark_exits_nonzero_with_its_stderr_tail(tmp_path, capsys):
    compare_trees = load_compare_trees()
    current, previous = fake_tree(tmp_path / "cur", 2.0), fake_tree(tmp_path / "prev", 4.0)
    argv = ["--current-tree", str(current), "--previous-tree", str(previous), "--out", str(tmp_path / "c.json"),
            "--", "broken.py"]
    assert compare_trees.main(argv) == 1
    err = capsys.readouterr().err
    assert "exited with 3" in err and "no good: the model is missing" in err
    assert not (tmp_path / "c.json").exists()


def test_timing_leaves_are_found_by_the_words_of_their_path():
    compare_trees = load_compare_trees()
    leaves = compare_trees.flatten({"results": [{"ours_total_s": 1.5, "speedup_total": 2, "identical": True}],
                                    "ms_per_frame": {"re_prefill": 3}, "tokens_per_s_per_repeat": [9],
                                    "audio": "x", "load_average": 1.0})
    assert leaves == {"results.0.ours_total_s": 1.5, "results.0.speedup_total": 2, "ms_per_frame.re_prefill": 3,
                      "tokens_per_s_per_repeat.0": 9, "load_average": 1.0}
    assert {path: compare_trees.better(path) for path in leaves} == {
        "results.0.ours_total_s": "lower", "results.0.speedup_total": "higher", "ms_per_frame.re_prefill": "lower",
        "tokens_per_s_per_repeat.0": "higher", "load_average": None}
