"""Text helpers every family shares: the chat template, the opened assistant turn, speaker names."""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The templated prompt of chat messages, the assistant turn opened."""
    if not has_chat_template(tokenizer):
        raise ValueError("prompt: this checkpoint's tokenizer has no chat template; pass input_ids")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def speech_header_ids(tokenizer) -> list[int] | None:
    """The ids that open an assistant turn after a user turn (what a speech request's text follows), or None
    without a chat template. ValueError when the template does not open one."""
    if not has_chat_template(tokenizer):
        return None
    probe = [{"role": "user", "content": "x"}]
    opened = list(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True, return_dict=False))
    closed = list(tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=True, return_dict=False))
    if opened[: len(closed)] != closed or len(opened) == len(closed):
        raise ValueError("tokenizer: its chat template does not open an assistant turn after the prompt")
    return opened[len(closed):]


def match_speaker(speakers, name: str) -> str | None:
    """The speaker of `speakers` called `name` (case-insensitive), or None."""
    lowered = name.strip().lower()
    return next((speaker for speaker in speakers if speaker.lower() == lowered), None)
