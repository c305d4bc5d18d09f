"""`omnimtp spec` on a tiny checkpoint dir (target + MTP layer + byte tokenizer)."""

import json

import pytest
import torch

from omnimtp import MTPHead
from omnimtp.cli import main
from omnimtp.models.tiny import THINKER_VOCAB_SIZE
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.spec_decode.adaptive import DEFAULT_MAX_DRAFT_TOKENS
from omnimtp.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_ckpt")
    target = tiny_lm("glm4_moe", seed=0, vocab_size=THINKER_VOCAB_SIZE)
    torch.manual_seed(0)
    target.save_pretrained(path)
    MTPHead.from_config(target).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_spec_json_compare_greedy_matches(checkpoint, capsys):
    assert main(["spec", "--model", str(checkpoint), "--prompt", "Hello", "-k", "3", "--max-new-tokens", "12",
                 "--compare", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    for key in ("mean_acceptance_length", "acceptance_per_position", "tokens_per_s", "plain_tokens_per_s", "speedup",
                "generate_tokens_per_s", "speedup_vs_generate"):  # both baselines: plain_generate and generate
        assert key in result
    assert len(result["acceptance_per_position"]) == 3
    assert result["outputs_match"] is True
    # a random head: τ near 1 at k = 3 does not pay, and stderr says so in one line with τ and what to do
    assert result["mean_acceptance_length"] < 2.5
    warning = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "τ" in warning[0] and "-k auto" in warning[0]


def test_spec_auto_reports_its_costs_and_steps(checkpoint, capsys):
    assert main(["spec", "--model", str(checkpoint), "--prompt", "Hello", "-k", "auto", "--max-new-tokens", "12",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["draft_costs"]) == DEFAULT_MAX_DRAFT_TOKENS + 1 and result["draft_costs"][0] == 1.0
    assert result["draft_costs_by_batch"] == {"1": result["draft_costs"]}  # per batch-size bucket; batch 1 here
    assert sum(result["draft_histogram"].values()) == result["num_steps"]


def test_spec_sampled_text_output(checkpoint, capsys):
    args = ["spec", "--model", str(checkpoint), "--prompt", "Hi", "-k", "2", "--max-new-tokens", "8",
            "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "tau" in first
    assert main(args) == 0
    assert capsys.readouterr().out.split("tau")[0] == first.split("tau")[0]  # seeded: same text


def test_spec_bad_args(checkpoint, tmp_path, capsys):
    """Bad input is a message naming it and exit code 2, not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["spec", "--model", str(checkpoint), "--prompt", "x", "-k", "0"])
    assert exit_info.value.code == 2
    assert "omnimtp spec: error: argument -k/--num-draft-tokens" in capsys.readouterr().err
    target = tiny_lm("glm4_moe", seed=0, vocab_size=THINKER_VOCAB_SIZE)
    target.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    assert main(["spec", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "missing" in capsys.readouterr().err
