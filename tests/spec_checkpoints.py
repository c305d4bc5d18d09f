"""End to end for a family: `omnimtp train-mtp --with-target` → `load_target_and_head` → `omnimtp spec --model`."""

import torch

from omnimtp import speculative_generate


def train_save_load_and_spec(target, tmp_path, capsys) -> None:
    """`omnimtp train-mtp --with-target` trains a head for the family and writes a complete checkpoint (target
    + the head under the family's export keys); `load_target_and_head` reads it back (same weights: transformers
    ignores the head's keys), decodes losslessly, and `omnimtp spec --model` on it matches plain decoding."""
    import json

    from text_corpus import write_code_corpus_and_model

    from omnimtp import load_target_and_head
    from omnimtp.cli import main

    data, model_dir, tokenizer = write_code_corpus_and_model(target, tmp_path)
    out = tmp_path / "out"
    assert main(["train-mtp", "--model", str(model_dir), "--data", str(data), "--out", str(out), "-k", "2",
                 "--steps", "6", "--batch-size", "2", "--seq-len", "16", "--eval-every", "6", "--num-eval-windows", "2",
                 "--heldout-every", "3", "--with-target", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 6
    evals = json.loads((out / "mtp_train_log.json").read_text())["evals"]
    assert evals[-1]["ce"] < evals[0]["ce"]  # the head learned something of the target

    loaded_target, loaded_head = load_target_and_head(out)
    assert type(loaded_target) is type(target)
    for name, value in target.state_dict().items():
        assert torch.equal(loaded_target.state_dict()[name], value), name
    from safetensors import safe_open

    with safe_open(out / "model-mtp.safetensors", "pt") as f:
        assert all(key.startswith(loaded_head.checkpoint_prefix) for key in f.keys())
    prompt = torch.tensor([tokenizer("def f3(x): ret").input_ids])
    reference = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=-1)
    ours = speculative_generate(
        loaded_target, loaded_head, prompt, max_new_tokens=12, num_draft_tokens=3, eos_token_id=-1
    )
    assert torch.equal(ours.sequences, reference)

    assert main(["spec", "--model", str(out), "--prompt", "def f1(x):", "-k", "2", "--max-new-tokens", "10",
                 "--compare", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outputs_match"] is True and len(result["acceptance_per_position"]) == 2
