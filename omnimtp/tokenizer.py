"""A byte-level text tokenizer for the embedded tiny Qwen3-Omni.

Ids 0..255 are the UTF-8 bytes, the specials of `omnimtp.models.tiny.THINKER_SPECIAL_TOKENS` follow.
It is a `PreTrainedTokenizerFast` with a Qwen-style chat template, so `apply_chat_template`,
`save_pretrained` and `AutoTokenizer.from_pretrained` work on it like on a real checkpoint's tokenizer,
and it names its media tokens as `Qwen3OmniMoeProcessor` expects (`audio_token`, `image_token`, ...).

    >>> tok = byte_tokenizer()
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    [256, 262, 10, 72, 105, 257, 10, 256, 263, 10]
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS

# Role names are single tokens (the talker finds user turns by the id after <|im_start|>); they only
# match as whole words, so "username" stays bytes.
ROLE_TOKENS = ("system", "user", "assistant")

# The multimodal tokens under the names transformers' Qwen3-Omni processor reads from its tokenizer
# (saved in tokenizer_config.json, so they survive save_pretrained / from_pretrained).
MEDIA_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}

# Content parts render as Qwen3-Omni's own template renders them: one pad per media part between its
# start and end tokens (the processor expands the pad to one per encoder row), text parts as text.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' or 'audio' in part or 'audio_url' in part %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(special_tokens: dict[str, int] = THINKER_SPECIAL_TOKENS) -> PreTrainedTokenizerFast:
    """A tiny model's tokenizer: 256 byte tokens + the thinker specials at their fixed ids (default the tiny
    Qwen3-Omni's; `omnimtp.models.tiny_qwen2_5_omni.QWEN2_5_THINKER_SPECIAL_TOKENS` for the tiny Qwen2.5-Omni)."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    for name, token_id in sorted(special_tokens.items(), key=lambda item: item[1]):
        is_role = name in ROLE_TOKENS
        tokenizer.add_tokens([AddedToken(name, special=not is_role, single_word=is_role, normalized=False)])
        if tokenizer.token_to_id(name) != token_id:
            raise RuntimeError(f"special token {name!r} got id {tokenizer.token_to_id(name)}, expected {token_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        chat_template=QWEN_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **MEDIA_TOKENS,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))
