"""MTP head training: the unrolled chain equals inference drafting, losses/estimates on hand-built tensors,
training lowers the loss and raises held-out acceptance, resume == uninterrupted, the saved head round-trips
through from_pretrained and transformers' generate(use_mtp=True), the train-mtp CLI end to end."""

import json

import pytest
import torch
from text_corpus import write_code_corpus_and_model

from omnimtp import MTPHead, MTPTrainConfig, load_target_and_head, speculative_generate, train_mtp_head
from omnimtp.cli import main as cli_main
from omnimtp.models.tiny_lm import TINY_LM_VOCAB_SIZE, tiny_lm
from omnimtp.mtp.train import (
    acceptance_estimate,
    collect_text_files,
    distillation_losses,
    teacher_outputs,
    unrolled_draft_logits,
    window_acceptance,
)


@pytest.fixture(scope="module")
def target():
    return tiny_lm("glm4_moe", seed=0)


def _fresh_head(target, seed=1):
    torch.manual_seed(seed)
    return MTPHead.from_config(target)


def _stream(num_tokens, seed):
    return torch.randint(3, TINY_LM_VOCAB_SIZE, (num_tokens,), generator=torch.Generator().manual_seed(seed)).int()


def test_unrolled_chain_equals_cached_inference_drafting(target):
    """Step 1 is the head's plain forward; step i at row t equals drafting with the head's KV cache holding
    step-1 rows 0..t and the chain rows — the attention pattern the proposer has at inference."""
    head = _fresh_head(target)
    input_ids = _stream(24, seed=2).long().view(2, 12)
    hidden, _ = teacher_outputs(target, input_ids)
    with torch.no_grad():
        chain = unrolled_draft_logits(head, input_ids, hidden, num_steps=3)
        assert [c.shape[1] for c in chain] == [11, 10, 9]
        torch.testing.assert_close(chain[0], head(input_ids[:, 1:], hidden[:, :-1]).logits, rtol=0, atol=0)
        for t in (0, 4, 8):
            cache = head.make_cache()
            out = head(input_ids[:, 1 : t + 2], hidden[:, : t + 1], cache=cache)
            prev = out.hidden[:, -1:]
            for step in (2, 3):
                out = head(input_ids[:, t + step : t + step + 1], prev, cache=cache)
                prev = out.hidden
                torch.testing.assert_close(out.logits[:, 0], chain[step - 1][:, t], rtol=1e-5, atol=1e-5)


def test_losses_and_acceptance_estimate_on_hand_built_logits():
    target_logits = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    # A drafter that reproduces the teacher exactly: step i row t = target row t + i.
    exact = [target_logits[:, i:].clone() for i in (1, 2)]
    ce, tv = distillation_losses(target_logits, exact)
    for i, (c, t) in enumerate(zip(ce, tv, strict=True), start=1):
        p = target_logits[:, i:].softmax(-1)
        torch.testing.assert_close(c, -(p * p.log()).sum(-1).mean())  # CE(p, p) = entropy
        assert t.abs().item() < 1e-6
    estimate = acceptance_estimate(target_logits, exact)
    assert estimate["tau_greedy"] == pytest.approx(3.0) and estimate["tau_sampled"] == pytest.approx(3.0)
    # A drafter that is certain of a token the target never picks: nothing accepted.
    wrong_token = (target_logits.argmin(-1))  # [2, 6]
    wrong = [torch.nn.functional.one_hot(wrong_token[:, i:], 5).float() * 1e4 for i in (1, 2)]
    estimate = acceptance_estimate(target_logits, wrong)
    assert estimate["tau_greedy"] == 1.0
    p_min = target_logits.softmax(-1).min(-1).values[:, 1:5]  # acceptance of step 1 = p(argmin)
    assert estimate["acceptance_per_position_sampled"][0] == pytest.approx(p_min.mean().item(), rel=1e-4)


def test_window_acceptance_is_per_window_and_averages_to_the_estimate():
    """Per-window rates: a window drafted exactly accepts everything, one drafted with the target's argmin
    accepts nothing greedily; their mean over windows is `acceptance_estimate`'s figure."""
    target_logits = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(1))
    draft = [target_logits[:, i:].clone() for i in (1, 2, 3)]
    wrong_token = target_logits.argmin(-1)  # [3, 7]
    for i in (1, 2, 3):
        draft[i - 1][1] = torch.nn.functional.one_hot(wrong_token[1, i:], 5).float() * 1e4
    rates = window_acceptance(target_logits, draft)
    assert rates["greedy"].shape == (3, 3) and rates["sampled"].shape == (3, 3)
    torch.testing.assert_close(rates["greedy"][0], torch.ones(3))
    torch.testing.assert_close(rates["greedy"][1], torch.zeros(3))
    torch.testing.assert_close(rates["sampled"][2], torch.ones(3))
    assert (rates["sampled"][1] < 1).all()
    estimate = acceptance_estimate(target_logits, draft)
    assert estimate["tau_greedy"] == pytest.approx(1 + rates["greedy"].mean(0).sum().item())
    assert estimate["acceptance_per_position_sampled"] == pytest.approx(rates["sampled"].mean(0).tolist())


def test_tv_weight_schedule():
    constant = MTPTrainConfig(steps=11, tv_weight=2.0)
    assert [constant.tv_weight_at(s) for s in (0, 5, 10)] == [2.0, 2.0, 2.0]
    ramp = MTPTrainConfig(steps=11, tv_weight=3.0, tv_weight_start=0.0)
    assert [ramp.tv_weight_at(s) for s in (0, 5, 10)] == pytest.approx([0.0, 1.5, 3.0])


def test_training_lowers_loss_and_raises_heldout_acceptance(target):
    head = _fresh_head(target)
    config = MTPTrainConfig(num_draft_tokens=2, steps=20, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=3,
                            eval_every=20, num_eval_windows=8)
    result = train_mtp_head(target, head, _stream(4000, 10), _stream(1500, 11), config, progress=False)
    before, after = result.evals[0], result.evals[-1]
    assert [e["step"] for e in result.evals] == [0, 20]
    assert sum(result.losses[-5:]) < sum(result.losses[:5])
    assert after["ce"] < before["ce"] and after["tv"] < before["tv"]
    assert after["tau_sampled"] > before["tau_sampled"]
    assert after["tau_greedy"] > before["tau_greedy"]
    assert not any(p.requires_grad is False for p in target.parameters())  # the caller's flags are restored
    assert target.get_input_embeddings().weight.grad is None  # the shared embedding was never trained


def test_resume_matches_an_uninterrupted_run(target, tmp_path):
    config = MTPTrainConfig(num_draft_tokens=2, steps=6, batch_size=2, seq_len=16, warmup_steps=2,
                            checkpoint_every=3, eval_every=6, num_eval_windows=2)
    train, held_out = _stream(2000, 20), _stream(500, 21)
    whole = train_mtp_head(target, _fresh_head(target), train, held_out, config, progress=False)
    first = train_mtp_head(target, _fresh_head(target), train, held_out, config, checkpoint_dir=tmp_path,
                           stop_after=3, progress=False)
    assert len(first.losses) == 3
    resumed = train_mtp_head(target, _fresh_head(target, seed=99), train, held_out, config,
                             checkpoint_dir=tmp_path, resume=True, progress=False)
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)
    for (name, a), (_, b) in zip(whole.head.state_dict().items(), resumed.head.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_trained_head_round_trips_and_transformers_use_mtp_is_lossless(target, tmp_path):
    head = _fresh_head(target)
    config = MTPTrainConfig(num_draft_tokens=2, steps=8, batch_size=2, seq_len=16, eval_every=8, num_eval_windows=2)
    train_mtp_head(target, head, _stream(2000, 30), _stream(500, 31), config, progress=False)
    target.save_pretrained(tmp_path)
    head.save_pretrained(tmp_path)
    loaded_target, loaded_head = load_target_and_head(tmp_path)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded_head.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    prompt = _stream(7, 32).long()[None]
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    hf_mtp = loaded_target.generate(prompt, max_new_tokens=16, do_sample=False, use_mtp=True)
    ours = speculative_generate(loaded_target, loaded_head, prompt, max_new_tokens=16, num_draft_tokens=3)
    assert torch.equal(hf_mtp, plain) and torch.equal(ours.sequences, plain)


def test_config_and_data_validation(tmp_path):
    for kwargs, name in [({"num_draft_tokens": 0}, "num_draft_tokens"), ({"steps": 0}, "steps"),
                         ({"lr": -1.0}, "lr"), ({"tv_weight": float("nan")}, "tv_weight"),
                         ({"step_weights": (1.0,)}, "step_weights"), ({"seq_len": 3}, "seq_len"),
                         ({"tv_weight_start": -1.0}, "tv_weight_start")]:
        with pytest.raises(ValueError, match=name):
            MTPTrainConfig(**kwargs)
    with pytest.raises(ValueError, match="paths"):
        collect_text_files([tmp_path / "missing"])
    with pytest.raises(ValueError, match="heldout_every"):
        collect_text_files([tmp_path], heldout_every=1)


def test_collect_text_files_split_is_deterministic_and_skips_tests(tmp_path):
    for i in range(40):
        (tmp_path / f"m{i}.py").write_text("x = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("y = 2\n")
    (tmp_path / "notes.bin").write_text("skip")
    train, held_out = collect_text_files([tmp_path], heldout_every=4)
    assert len(train) + len(held_out) == 40 and held_out
    assert not set(train) & set(held_out)
    assert collect_text_files([tmp_path], heldout_every=4) == (train, held_out)


def test_train_mtp_cli_end_to_end(target, tmp_path, capsys):
    data, model_dir, tokenizer = write_code_corpus_and_model(target, tmp_path)
    assert len(tokenizer) <= TINY_LM_VOCAB_SIZE
    out = tmp_path / "out"
    args = ["train-mtp", "--model", str(model_dir), "--data", str(data), "--out", str(out), "-k", "2",
            "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--num-eval-windows", "2",
            "--checkpoint-every", "2", "--heldout-every", "3", "--with-target", "--no-progress"]
    assert cli_main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 4 and summary["tau_greedy"] >= 1.0
    assert (out / "model-mtp.safetensors").exists() and (out / "config.json").exists()
    assert [e["step"] for e in json.loads((out / "mtp_train_log.json").read_text())["evals"]] == [0, 2, 4]
    loaded_target, loaded_head = load_target_and_head(out)
    assert loaded_head.layer_idx == target.config.num_hidden_layers
    assert cli_main(args + ["--resume", "--steps", "6"]) == 0  # continues from the saved state at step 4
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["step"] == 6
    # --no-progress still says what happened, in a line for people
    assert lines[-2].startswith("train-mtp: resumed at step 4, steps 4→6 of 6 in ")
    assert f"head written to {out}" in lines[-2]


def test_a_head_for_a_qwen3_target_trains_saves_and_decodes_losslessly(tmp_path):
    """Qwen3 has no MTP layer of its own; train-mtp gives it one, stored as model.layers.{N}.*."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=TINY_LM_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.2)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    head = _fresh_head(target)
    train_mtp_head(target, head, _stream(2000, 40), _stream(500, 41),
                   MTPTrainConfig(num_draft_tokens=2, steps=4, batch_size=2, seq_len=16, num_eval_windows=2),
                   progress=False)
    target.save_pretrained(tmp_path)
    head.save_pretrained(tmp_path)
    loaded_target, loaded_head = load_target_and_head(tmp_path)
    assert loaded_head.layer_idx == 2
    prompt = _stream(6, 42).long()[None]
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    ours = speculative_generate(loaded_target, loaded_head, prompt, max_new_tokens=12, num_draft_tokens=3)
    assert torch.equal(ours.sequences, plain)
