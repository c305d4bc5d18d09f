"""Self-distillation data for MTP head training: rows are a training-text window followed by the target's own
greedy (or seeded sampled) continuation, reproducible and independent of the batch size; training on them runs
and is reproducible; gen-distill-data + train-mtp --distill-data end to end; argument errors."""

import dataclasses
import json

import pytest
import torch
from text_corpus import write_code_corpus_and_model

from omnimtp import MTPHead, MTPTrainConfig, generate_distill_rows, train_mtp_head
from omnimtp.cli import main as cli_main
from omnimtp.models.tiny_lm import TINY_LM_VOCAB_SIZE, tiny_lm
from omnimtp.mtp.train import sample_windows
from omnimtp.mtp.train_cli import load_distill_rows


@pytest.fixture(scope="module")
def target():
    return tiny_lm("glm4_moe", seed=0)


def _stream(num_tokens, seed):
    return torch.randint(3, TINY_LM_VOCAB_SIZE, (num_tokens,), generator=torch.Generator().manual_seed(seed)).int()


def _greedy_reference(target, prompt, num_new_tokens):
    """Greedy continuation by full recomputation (no cache, no EOS stop): argmax of the last row, appended."""
    ids = prompt[None].long()  # [1, P]
    with torch.no_grad():
        for _ in range(num_new_tokens):
            next_token = target(input_ids=ids).logits[:, -1].argmax(-1)  # [1]
            ids = torch.cat([ids, next_token[:, None]], dim=1)
    return ids[0]


def _find_window(stream, window):
    """Start of `window` in `stream`, or None."""
    for start in range(stream.numel() - window.numel() + 1):
        if torch.equal(stream[start : start + window.numel()], window):
            return start
    return None


def test_rows_are_training_windows_followed_by_the_targets_greedy_continuation(target):
    stream = _stream(400, seed=3)
    rows = generate_distill_rows(target, stream, 5, seq_len=20, prompt_len=6, batch_size=2, progress=False)
    assert rows.shape == (5, 20) and rows.dtype == torch.int32
    for row in rows:
        assert _find_window(stream, row[:6]) is not None
        torch.testing.assert_close(row.long(), _greedy_reference(target, row[:6], 14), rtol=0, atol=0)
    again = generate_distill_rows(target, stream, 5, seq_len=20, prompt_len=6, batch_size=5, progress=False)
    assert torch.equal(rows, again)
    other_seed = generate_distill_rows(target, stream, 5, seq_len=20, prompt_len=6, seed=1, progress=False)
    assert not torch.equal(rows[:, :6], other_seed[:, :6])  # the seed draws the prompt windows


def test_sampled_rows_are_seeded_per_row(target):
    stream = _stream(400, seed=4)
    kwargs = dict(seq_len=24, prompt_len=4, temperature=1.0, progress=False)
    rows = generate_distill_rows(target, stream, 6, batch_size=4, seed=7, **kwargs)
    assert torch.equal(rows, generate_distill_rows(target, stream, 6, batch_size=1, seed=7, **kwargs))
    greedy = generate_distill_rows(target, stream, 6, seq_len=24, prompt_len=4, seed=7, progress=False)
    assert torch.equal(rows[:, :4], greedy[:, :4]) and not torch.equal(rows, greedy)
    assert not torch.equal(rows[:, 4:], generate_distill_rows(target, stream, 6, batch_size=4, seed=8, **kwargs)[:, 4:])


def test_training_on_distill_rows_runs_and_is_reproducible(target):
    stream = _stream(600, seed=5)
    rows = generate_distill_rows(target, stream, 8, seq_len=16, prompt_len=4, progress=False)
    batch = sample_windows(rows, step=3, batch_size=4, seq_len=16, seed=0)
    assert all(any(torch.equal(b, r.long()) for r in rows) for b in batch)  # whole rows are drawn
    config = MTPTrainConfig(num_draft_tokens=2, steps=3, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=1,
                            eval_every=3, num_eval_windows=2)
    results = []
    for _ in range(2):
        torch.manual_seed(1)
        head = MTPHead.from_config(target)
        results.append(train_mtp_head(target, head, rows, _stream(200, seed=6), config, progress=False))
    first, second = results
    assert len(first.losses) == 3 and all(torch.isfinite(torch.tensor(first.losses)))
    assert first.losses == second.losses
    for (name, a), (_, b) in zip(first.head.state_dict().items(), second.head.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # distill_rows with distill_fraction 1 is the same training as rows passed as the training stream.
    torch.manual_seed(1)
    as_rows = train_mtp_head(target, MTPHead.from_config(target), stream, _stream(200, seed=6), config,
                             progress=False, distill_rows=rows)
    assert as_rows.losses == first.losses
    # A mix: half of each batch from the rows, half from the text; differs from either alone.
    mixed_config = dataclasses.replace(config, distill_fraction=0.5)
    text_config = dataclasses.replace(config, distill_fraction=0.0)
    losses = []
    for cfg in (mixed_config, mixed_config, text_config):
        torch.manual_seed(1)
        losses.append(train_mtp_head(target, MTPHead.from_config(target), stream, _stream(200, seed=6), cfg,
                                     progress=False, distill_rows=rows).losses)
    assert losses[0] == losses[1] and losses[0] != first.losses and losses[0] != losses[2]
    torch.manual_seed(1)
    text_only = train_mtp_head(target, MTPHead.from_config(target), stream, _stream(200, seed=6), config,
                               progress=False)
    assert text_only.losses == losses[2]


def test_argument_errors(target, tmp_path):
    stream = _stream(100, seed=0)
    for kwargs, name in [
        (dict(num_rows=0), "num_rows"), (dict(prompt_len=0), "prompt_len"), (dict(batch_size=0), "batch_size"),
        (dict(seq_len=8, prompt_len=8), "seq_len"), (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
    ]:
        args = dict(num_rows=2, seq_len=12, prompt_len=4, progress=False) | kwargs
        with pytest.raises(ValueError, match=name):
            generate_distill_rows(target, stream, args.pop("num_rows"), **args)
    with pytest.raises(ValueError, match="train_stream"):
        generate_distill_rows(target, stream[:4], 1, seq_len=12, prompt_len=4, progress=False)
    config = MTPTrainConfig(num_draft_tokens=2, steps=1, batch_size=2, seq_len=16)
    with pytest.raises(ValueError, match="train_stream"):
        train_mtp_head(target, MTPHead.from_config(target), torch.zeros(4, 12, dtype=torch.int32), stream, config,
                       progress=False)
    with pytest.raises(ValueError, match="stream"):
        sample_windows(torch.zeros(0, 16, dtype=torch.int32), 0, 2, 16, 0)
    with pytest.raises(ValueError, match="--distill-data"):
        load_distill_rows(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="distill_rows"):
        train_mtp_head(target, MTPHead.from_config(target), stream, stream, config, progress=False,
                       distill_rows=torch.zeros(4, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match="distill_fraction"):
        MTPTrainConfig(distill_fraction=1.5)


def test_gen_distill_data_and_train_mtp_cli_end_to_end(target, tmp_path, capsys):
    data, model_dir, _ = write_code_corpus_and_model(target, tmp_path)
    distill = tmp_path / "distill.safetensors"
    gen_args = ["gen-distill-data", "--model", str(model_dir), "--data", str(data), "--heldout-every", "3",
                "--out", str(distill), "--num-tokens", "25", "--seq-len", "16", "--prompt-len", "4", "--no-progress"]
    assert cli_main(gen_args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert lines[-2].startswith("gen-distill-data: 3 rows of 16 tokens (36 generated) from ")
    rows = load_distill_rows(distill)
    assert rows.shape == (3, 16) and summary["rows"] == 3 and summary["generated_tokens"] == 36
    for row in rows:
        torch.testing.assert_close(row.long(), _greedy_reference(target, row[:4], 12), rtol=0, atol=0)
    assert cli_main(gen_args[:-1] + ["--out", str(tmp_path / "again.safetensors"), "--no-progress"]) == 0
    assert torch.equal(load_distill_rows(tmp_path / "again.safetensors"), rows)
    out = tmp_path / "out"
    train_args = ["train-mtp", "--model", str(model_dir), "--data", str(data), "--heldout-every", "3", "--out",
                  str(out), "-k", "2", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
                  "--num-eval-windows", "2", "--distill-data", str(distill), "--no-progress"]
    assert cli_main(train_args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    assert json.loads((out / "mtp_train_log.json").read_text())["distill_data"] == str(distill)
    assert (out / "model-mtp.safetensors").exists()
    bad_seq_len = [("12" if previous == "--seq-len" else a)
                   for previous, a in zip([None] + train_args, train_args, strict=False)]
    capsys.readouterr()
    assert cli_main(bad_seq_len) == 2
    assert "omnimtp train-mtp: error: --distill-data" in capsys.readouterr().err
    bad_num_tokens = [("0" if previous == "--num-tokens" else a)
                      for previous, a in zip([None] + gen_args, gen_args, strict=False)]
    assert cli_main(bad_num_tokens) == 2
    assert "--num-tokens" in capsys.readouterr().err
