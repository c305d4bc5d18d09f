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
    assert loaded.decode(list("ok".encode()) + [257], skip_special_tokens=True) == "ok"
