"""transformers' Qwen3-Omni `generate(return_audio=True)` as the tests' reference, greedy."""

import torch


def reference_generate(model, prompt_ids, max_new_tokens, max_frames, monkeypatch, **media):
    """(reply ids, talker codes [G, T], audio) of transformers' greedy generate on one prompt (and its
    media tensors). The codes are captured where transformers hands them to code2wav."""
    captured = []
    chunked_decode = model.code2wav.chunked_decode

    def capturing_decode(codes, *args, **kwargs):
        captured.append(codes.clone())
        return chunked_decode(codes, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(model.code2wav, "chunked_decode", capturing_decode)
        sequences, wav = model.generate(
            input_ids=torch.tensor([prompt_ids], device=model.device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
            return_audio=True, speaker="Ethan", thinker_max_new_tokens=max_new_tokens,
            thinker_eos_token_id=model.config.im_end_token_id, thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=max_frames + 1, **media,
        )
    assert len(captured) == 1
    return sequences[0, len(prompt_ids):].tolist(), captured[0][0].cpu(), wav[0, 0].cpu().numpy()
