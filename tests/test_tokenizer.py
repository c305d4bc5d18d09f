from transformers import AutoTokenizer

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS
from omnimtp.tokenizer import byte_tokenizer


def test_bytes_and_specials_have_fixed_ids():
    tok = byte_tokenizer()
    assert tok.encode("Hé", add_special_tokens=False) == list("Hé".encode())
    for name, token_id in THINKER_SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(name) == token_id
    assert tok.eos_token_id == THINKER_SPECIAL_TOKENS["<|im_end|>"]
    assert tok.encode("username", add_special_tokens=False) == list(b"username")


def test_chat_template_is_qwen_style_and_round_trips(tmp_path):
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ✓<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == text
    assert ids[-3:] == [256, 263, 10]
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == ids
    assert loaded.decode(list(b"ok") + [257], skip_special_tokens=True) == "ok"


def test_media_tokens_are_named_for_the_processor_and_survive_save_and_load(tmp_path):
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    expected = {"audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
                "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
    for t in (tok, loaded):
        for name, token in expected.items():
            assert getattr(t, name) == token
            assert getattr(t, f"{name}_id") == THINKER_SPECIAL_TOKENS[token]


def test_chat_template_renders_media_parts_as_qwen3_omni_does(tmp_path):
    tok = byte_tokenizer()
    parts = [{"type": "audio", "audio": "q.wav"}, {"type": "text", "text": "What is "},
             {"type": "image", "image": "cat.png"}, {"type": "video", "video": "v.mp4"}, {"type": "text", "text": "?"}]
    messages = [{"role": "user", "content": parts}]
    text = ("<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>What is <|vision_start|><|image_pad|>"
            "<|vision_end|><|vision_start|><|video_pad|><|vision_end|>?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False) == text
    # text parts join into exactly what the same text as a string gives
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "✓"}]}]
    as_string = [{"role": "user", "content": "Hi ✓"}]
    assert (tok.apply_chat_template(text_parts, add_generation_prompt=True, return_dict=False)
            == tok.apply_chat_template(as_string, add_generation_prompt=True, return_dict=False))
